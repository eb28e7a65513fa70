# Delivery: `make demo`, the kustomize manifests generated from the Helm chart, chart lint.
.PHONY: demo manifests chart-lint

HELM_BIN = $(shell $(PY) -c 'from lorafleet_devcluster.cluster import tool_path; print(tool_path("helm"))')

# When the cluster tools cannot be built or found, demo.run_demo says what is missing and runs demo-worker.
demo: setup-python  ## whole system on this machine: control plane, MinIO, chart, adapters, requests (DEMO_KEEP=1 stays up)
	@$(MAKE) --no-print-directory setup || echo "==> make setup failed (above): the demo checks what it can run"
	$(PY) -m demo.run_demo

manifests: setup  ## regenerate manifests/ (kustomize base + dev overlay) from charts/lorafleet
	HELM="$(HELM_BIN)" manifests/render.sh

chart-lint: setup  ## helm lint the chart (strict)
	"$(HELM_BIN)" lint --strict charts/lorafleet
