#!/usr/bin/env bash
# Wheels that a bare GPU machine (CUDA torch, Triton, transformers, peft, pytest preinstalled; Python 3.12;
# no network) lacks for `make gpu-check-bare`, at the versions in this checkout's .venv, into .whl/.
# There: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site make gpu-check-bare
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
NEEDED="blake3 llguidance pyzmq pytest-asyncio sniffio fastapi starlette pydantic pydantic_core annotated-types
typing-inspection typing_extensions uvicorn partial-json-parser opentelemetry-api annotated-doc"
pins=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | tr 'A-Z_' 'a-z-')
reqs=()
for name in $NEEDED; do
    key=$(echo "$name" | tr 'A-Z_' 'a-z-')
    pin=$(echo "$pins" | grep "^$key==" || true)
    [ -n "$pin" ] || { echo "gpu-wheels: $name is not in .venv (run make setup)" >&2; exit 1; }
    reqs+=("$pin")
done
mkdir -p .whl
platforms=()
for p in manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
    manylinux_2_31_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    "${platforms[@]}" -d .whl "${reqs[@]}"
echo "gpu-wheels: $(ls .whl/*.whl | wc -l) wheels in .whl/ ($(du -sh .whl | cut -f1))"
