# The vLLM sidecar (sidecar/, lorafleet-vllm-sidecar) against a real vLLM: vLLM's CPU build (`make vllm`), the real
# model and the trained adapters, a local MinIO; then the chart's mixed fleet on the local cluster (a lorafleet group
# and a vLLM group, `vllmWorkers`, for one base model; Dynamo's manifest; a hot swap and a vLLM pod restart under
# traffic). Not part of `make test` (vLLM takes minutes to start on a small CPU; there the tests are skipped); the
# sidecar's own tests against a fake vLLM are.
.PHONY: e2e-vllm

VLLM_E2E_TESTS ?= tests/sidecar/test_vllm_real.py tests/e2e/test_chart_vllm_fleet.py

e2e-vllm: setup vllm adapters  ## real vLLM: the sidecar alone, then a chart fleet of lorafleet + vLLM pods (swap, restart; ~15 min)
	LORAFLEET_VLLM_E2E=1 $(PY) -m pytest $(VLLM_E2E_TESTS) -s $(PYTEST_ARGS)
