# Local Kubernetes control plane (issue 3): Go-built tools, the e2e suite, kind variant.
# See docs/local-cluster.md.
.PHONY: go-tools cluster-up cluster-down e2e e2e-kind

KIND_CLUSTER ?= lorafleet-e2e
# Images the e2e suite needs inside kind (build them first, e.g. with docker build).
E2E_KIND_IMAGES ?= lorafleet/worker:dev-dev lorafleet/operator:dev

go-tools:  ## build kube-apiserver, controller-manager, kubectl, etcd, helm from Go modules (cached per version)
	@tools/build-go-tools.sh

setup: go-tools

cluster-up: setup  ## start the local control plane + node agent in the background (prints the kubeconfig)
	@$(VENV)/bin/lorafleet-devcluster up

cluster-down:  ## stop what cluster-up started
	@$(VENV)/bin/lorafleet-devcluster down

e2e: setup  ## run the e2e suite on a local control plane (no Docker needed)
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

e2e-kind: setup-python  ## run the e2e suite on a kind cluster (needs Docker, kind, kubectl; not possible here)
	@command -v docker >/dev/null && command -v kind >/dev/null && command -v kubectl >/dev/null || \
		{ echo "e2e-kind needs docker, kind and kubectl on PATH"; exit 1; }
	@kind get clusters | grep -qx '$(KIND_CLUSTER)' || kind create cluster --name '$(KIND_CLUSTER)' --wait 120s
	@for img in $(E2E_KIND_IMAGES); do kind load docker-image --name '$(KIND_CLUSTER)' "$$img"; done
	LORAFLEET_E2E_CLUSTER=kubeconfig KUBECONFIG="$$(mktemp)" bash -c \
		'kind get kubeconfig --name "$(KIND_CLUSTER)" > "$$KUBECONFIG" && $(PY) -m pytest tests/e2e $(PYTEST_ARGS)'
