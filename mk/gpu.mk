# GPU path: Triton kernel benchmark. Needs a CUDA device; --dry-run checks the script on CPU.
.PHONY: bench-gpu bench-gpu-dry-run test-kernels gpu-check gpu-check-bare gpu-check-run
GPU_CHECK_DIR ?= bench/gpu-check

bench-gpu: setup-python  ## Triton kernels vs torch (GB/s, FLOP/s, % of peak) + e2e multi-LoRA decode tok/s (CUDA)
	$(PY) bench/bench_gpu.py --out bench/gpu.json --markdown bench/gpu.md

bench-gpu-dry-run: setup-python  ## bench-gpu on CPU under the Triton interpreter, tiny shapes (checks the script)
	$(PY) bench/bench_gpu.py --dry-run

test-kernels: setup-python  ## Triton kernel tests (interpreter on CPU; compiled on a GPU); LORAFLEET_GPU_LARGE=1 adds large shapes
	$(PY) -m pytest tests/kernels $(PYTEST_ARGS)

gpu-check: setup-python gpu-check-run  ## on a CUDA machine: every GPU test (a skip fails), the kernel benchmarks, the tile sweep, the Llama-3-8B-shape roofline eager and with CUDA graphs, the decode profile (~10 min; tools/gpu-check.sh); results in $(GPU_CHECK_DIR)/

# A bare GPU machine (CUDA torch, Triton, transformers, peft, pytest preinstalled; no venv, no network):
# the system python with the sources on PYTHONPATH. The worker's other packages (fastapi, pydantic, pyzmq,
# llguidance, blake3, pytest-asyncio, ...) travel as wheels: tools/gpu-wheels.sh puts them in .whl/.
gpu-check-bare:  ## gpu-check with the system python3 and the sources on PYTHONPATH (no setup, no network)
	PYTHONPATH=$(CURDIR):$(CURDIR)/worker/src:$(CURDIR)/worker/dev/src:$(CURDIR)/jobs/src$${PYTHONPATH:+:$$PYTHONPATH} \
		$(MAKE) gpu-check-run PY=python3

gpu-check-run:
	@PY=$(PY) GPU_CHECK_DIR=$(GPU_CHECK_DIR) PYTEST_ARGS="$(PYTEST_ARGS)" tools/gpu-check.sh
