# GPU path (issue 6): Triton kernel benchmark. Needs a CUDA device; --dry-run checks the script on CPU.
.PHONY: bench-gpu bench-gpu-dry-run test-kernels

bench-gpu: setup-python  ## Triton kernels vs torch (GB/s, FLOP/s, % of peak) + e2e multi-LoRA decode tok/s (CUDA)
	$(PY) bench/bench_gpu.py --out bench/gpu.json --markdown bench/gpu.md

bench-gpu-dry-run: setup-python  ## bench-gpu on CPU under the Triton interpreter, tiny shapes (checks the script)
	$(PY) bench/bench_gpu.py --dry-run

test-kernels: setup-python  ## Triton kernel tests (interpreter on CPU; compiled on a GPU); LORAFLEET_GPU_LARGE=1 adds large shapes
	$(PY) -m pytest tests/kernels $(PYTEST_ARGS)
