# Images: build them with docker or podman, and run the chart e2e with every lorafleet pod
# from them. See docs/install.md#images and docs/local-cluster.md.
.PHONY: images e2e-images container-engine

IMAGE_TAG ?= dev
export IMAGE_TAG

images:  ## build lorafleet/operator, lorafleet/worker and its -dev variant (docker, else podman)
	@tools/images.sh $(IMAGES)

e2e-images: setup  ## the chart e2e with the operator, router, sync Jobs, workers and bucket helper run from the built images
	@tools/images.sh operator worker-dev
	LORAFLEET_NODE_RUNTIME=podman $(PY) -m pytest tests/infra/test_podman_mode.py tests/e2e/test_chart_install.py $(PYTEST_ARGS)

# Setup provides a container engine for `make images` where it can (docker, else podman via apt as root);
# where it cannot, it says what to install and the rest of setup goes on.
container-engine:
	@engine=$$(tools/container-engine.sh) && echo "==> container engine for make images: $$engine" || \
		echo "==> no container engine: make images / make e2e-images will not run (see the message above)"

setup: container-engine
