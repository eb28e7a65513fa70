#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize (the peer `make bench-peers` compares with) from the
# hash-pinned PyPI sdist of llama-cpp-python, which carries the whole llama.cpp tree under vendor/llama.cpp.
#
# Everything lands in $LORAFLEET_CACHE/llama.cpp-<version>/: src/ (the unpacked tree, whose
# convert_hf_to_gguf.py, convert_lora_to_gguf.py and gguf-py the GGUF preparation uses), bin/llama-server,
# bin/llama-quantize, build.log. A second run finds the binaries and builds nothing.
#
# cmake and ninja come from PATH, or from the PyPI wheels `cmake` / `ninja` installed into a small venv
# under the cache when PATH lacks them; a C++ compiler must be on PATH. Without one the script prints what
# is missing and exits 3 (the benchmark then records a skip instead of failing).
#
# Usage: tools/build-llama-cpp.sh          prints the directory (last line of stdout) once built
set -euo pipefail

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CACHE="${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}"
DIR="$CACHE/llama.cpp-$VERSION"
JOBS="${LLAMA_BUILD_JOBS:-2}"
PYTHON="${PYTHON:-python3}"

log() { printf '==> [llama.cpp] %s\n' "$*" >&2; }
missing() { log "cannot build: $*"; exit 3; }

if [ -x "$DIR/bin/llama-server" ] && [ -x "$DIR/bin/llama-quantize" ]; then
  log "cached: $DIR/bin/{llama-server,llama-quantize}"
  echo "$DIR"
  exit 0
fi
mkdir -p "$DIR/bin"
LOG="$DIR/build.log"
: >"$LOG"

failed() {  # failed WHAT : the last 40 lines of the log and its path, then exit 1
  log "$1 FAILED; last 40 lines of $LOG:"
  tail -n 40 "$LOG" >&2
  log "full log: $LOG"
  exit 1
}

# Toolchain: a compiler is required; cmake and ninja may come from PyPI wheels.
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1 ||
  missing "no C++ compiler on PATH (install g++ or clang++, e.g. apt-get install g++)"
if ! command -v cmake >/dev/null 2>&1 || ! command -v ninja >/dev/null 2>&1; then
  tools="$DIR/build-tools"
  if [ ! -x "$tools/bin/cmake" ] || [ ! -x "$tools/bin/ninja" ]; then
    log "cmake or ninja not on PATH: installing the PyPI wheels into $tools"
    { "$PYTHON" -m venv "$tools" && "$tools/bin/pip" install -q cmake ninja; } >>"$LOG" 2>&1 ||
      missing "cmake/ninja are not on PATH and the PyPI wheels could not be installed (see $LOG);" \
        "install them (apt-get install cmake ninja-build, or pip install cmake ninja)"
  fi
  export PATH="$tools/bin:$PATH"
fi

# The sdist, checked against its pinned hash.
sdist="$DIR/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ] || ! echo "$SHA256  $sdist" | sha256sum -c --status; then
  log "downloading the llama-cpp-python $VERSION sdist from PyPI"
  req="$DIR/sdist-requirement.txt"
  echo "llama-cpp-python==$VERSION --hash=sha256:$SHA256" >"$req"
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$req" -d "$DIR" >>"$LOG" 2>&1 ||
    failed "download"
fi
echo "$SHA256  $sdist" | sha256sum -c --status || { log "sha256 of $sdist differs from $SHA256"; exit 1; }

if [ ! -f "$DIR/src/CMakeLists.txt" ]; then
  rm -rf "$DIR/src" "$DIR/unpack" && mkdir -p "$DIR/unpack"
  tar -xzf "$sdist" -C "$DIR/unpack"
  mv "$DIR/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR/src" && rm -rf "$DIR/unpack"
fi

# The prebuilt web UI is off (it would be downloaded); no OpenSSL, static, tuned to this CPU.
log "building llama-server and llama-quantize ($JOBS jobs; several minutes; log: $LOG)"
start=$(date +%s)
nice -n 10 cmake -S "$DIR/src" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >>"$LOG" 2>&1 ||
  failed "cmake configure"
nice -n 10 ninja -C "$DIR/build" -j "$JOBS" llama-server llama-quantize >>"$LOG" 2>&1 || failed "ninja build"
cp "$DIR/build/bin/llama-server" "$DIR/build/bin/llama-quantize" "$DIR/bin/"
log "built in $(( $(date +%s) - start )) s: $DIR/bin/{llama-server,llama-quantize}"
echo "$DIR"
