# Local Kubernetes control plane: Go-built tools, the e2e suite; the kind variant.
# See docs/local-cluster.md.
.PHONY: go-tools cluster-up cluster-down e2e e2e-kind e2e-kind-multinode kind-node

KIND_CLUSTER ?= lorafleet-e2e
export KIND_CLUSTER
# The chart e2e files e2e-kind runs (PYTEST_ARGS goes after them).
KIND_E2E_TESTS ?= tests/e2e/test_chart_install.py tests/e2e/test_chart_autoscale.py tests/e2e/test_restricted_namespace.py

go-tools:  ## build kube-apiserver, controller-manager, kubectl, etcd, helm from Go modules (cached per version)
	@tools/build-go-tools.sh

setup: go-tools

cluster-up: setup  ## start the local control plane + node agent in the background (prints the kubeconfig)
	@$(VENV)/bin/lorafleet-devcluster up

cluster-down:  ## stop what cluster-up started
	@$(VENV)/bin/lorafleet-devcluster down

e2e: setup  ## run the e2e suite on a local control plane (no Docker needed)
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

kind-node: go-tools container-engine  ## build the kind toolchain (kind, kubelet, containerd, ...) and a kind node image from Go modules + Debian (cached)
	@engine=$$(tools/container-engine.sh 2>/dev/null) || engine=none; \
	case $$engine in \
		podman) tools/build-go-tools.sh kind && tools/kind-node.sh >/dev/null ;; \
		docker) tools/build-go-tools.sh kind && echo "==> docker: e2e-kind uses the official kindest/node image" ;; \
		*) echo "==> no container engine: no kind node image (make e2e-kind will not run)" ;; \
	esac

setup: kind-node

e2e-kind: setup  ## the chart e2e on a kind cluster (podman provider in a network namespace where there is no docker)
	@tools/kind-e2e.sh $(KIND_E2E_TESTS) $(PYTEST_ARGS)

# The chart e2e plus the multi-node files on kind with two worker nodes and kube-router (routes between the
# nodes, NetworkPolicy enforced). Heavy (three nodes): not part of CI's e2e-kind. docs/local-cluster.md.
KIND_MULTINODE_TESTS ?= $(KIND_E2E_TESTS) tests/e2e/test_kind_multinode.py tests/e2e/test_node_faults.py
e2e-kind-multinode: setup  ## the chart e2e, NetworkPolicy enforcement and node faults on kind: 1 control plane + 2 workers (kube-router)
	@KIND_WORKERS=2 tools/kind-e2e.sh $(KIND_MULTINODE_TESTS) $(PYTEST_ARGS)
