# The vLLM sidecar (sidecar/, lorafleet-vllm-sidecar) against a real vLLM: vLLM's CPU build (`make vllm`), the real
# model and the trained adapters, a local MinIO. Not part of `make test` (vLLM takes minutes to start on a small CPU;
# there the test is skipped); the sidecar's own tests against a fake vLLM are.
.PHONY: e2e-vllm

e2e-vllm: setup vllm adapters  ## the vLLM sidecar driving a real vLLM server: load from MinIO, chat, hot swap, unload (~5 min)
	LORAFLEET_VLLM_E2E=1 $(PY) -m pytest tests/sidecar/test_vllm_real.py -s $(PYTEST_ARGS)
