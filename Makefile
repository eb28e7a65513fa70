# lorafleet — one-command entry points. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(VENV)/bin/python
# Builds and downloads are cached outside the repository, keyed by version.
export LORAFLEET_CACHE ?= $(HOME)/.cache/lorafleet
# uv's package cache (downloads and built wheels); `make fresh-check` shares it with an empty LORAFLEET_CACHE.
export UV_CACHE_DIR ?= $(LORAFLEET_CACHE)/uv
PYTEST_ARGS ?=
# Python code that lint/fmt cover.
PY_DIRS := worker operator jobs sidecar devcluster tests bench demo tools

.PHONY: help setup setup-python test test-unit lint lock demo bench fmt clean fresh-check

help:  ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  %-14s %s\n", $$1, $$2}'

# Python side: a venv with the shipped projects (the vLLM sidecar included), the worker's dev tools and the dev
# cluster (editable) and pinned dev tools.
PY_STAMP := $(VENV)/.lorafleet-setup-$(shell cat constraints.txt locks/dev.txt requirements-dev.txt worker/pyproject.toml worker/dev/pyproject.toml operator/pyproject.toml jobs/pyproject.toml sidecar/pyproject.toml devcluster/pyproject.toml | sha256sum | cut -c1-16)

setup-python: $(PY_STAMP)
$(PY_STAMP): $(VENV)/bin/uv constraints.txt locks/dev.txt requirements-dev.txt worker/pyproject.toml worker/dev/pyproject.toml operator/pyproject.toml jobs/pyproject.toml sidecar/pyproject.toml devcluster/pyproject.toml
	@echo "==> installing the locked Python dependencies into $(VENV) (torch is ~3 GB on first run)"
	@$(VENV)/bin/uv pip install --python $(PY) -c constraints.txt -c locks/dev.txt \
		-e ./jobs -e ./operator -e ./sidecar -e './worker[dev]' -e ./worker/dev -e ./devcluster -r requirements-dev.txt
	@rm -f $(VENV)/.lorafleet-setup-*; touch $@
	@echo "==> Python environment ready"

# The venv and uv (the installer and lock tool), pinned by constraints.txt.
$(VENV)/bin/uv: constraints.txt
	@test -x $(VENV)/bin/pip || python3 -m venv --clear $(VENV)
	@$(VENV)/bin/pip install -q --disable-pip-version-check -c constraints.txt uv
	@touch $@

# locks/*.txt: the whole dependency closure of each image and of the dev venv, with hashes (tools/lock.py).
lock: $(VENV)/bin/uv  ## regenerate locks/ after changing constraints.txt, requirements-dev.txt or a pyproject's dependencies
	UV=$(VENV)/bin/uv $(VENV)/bin/python tools/lock.py

setup: setup-python  ## install everything (Python deps, Go-built tools); cached, a second run does nothing

test: setup  ## run every test (unit, integration, e2e)
	$(PY) -m pytest tests $(PYTEST_ARGS)

# Tests that need neither the Go-built cluster tools nor MinIO (a quick loop while editing).
UNIT_TESTS := tests/worker tests/operator tests/kernels tests/sidecar/test_vllm_sidecar.py tests/delivery/test_dockerfiles.py \
	tests/delivery/test_lock.py tests/delivery/test_image_packages.py
test-unit: setup-python  ## the tests that need no cluster tools or MinIO (worker, operator units, kernels, vLLM sidecar, images' packages, locks)
	$(PY) -m pytest $(UNIT_TESTS) $(PYTEST_ARGS)

lint: setup-python  ## ruff and mypy
	$(VENV)/bin/ruff check $(PY_DIRS)
	$(VENV)/bin/ruff format --check $(PY_DIRS)
	$(VENV)/bin/mypy

fmt: setup-python  ## format the code
	$(VENV)/bin/ruff format $(PY_DIRS)
	$(VENV)/bin/ruff check --fix $(PY_DIRS)

# A new user's first hour: the README's two commands on a clean clone with an empty LORAFLEET_CACHE (tools/fresh-check.sh).
fresh-check:  ## make demo + make test on a clean clone of HEAD with an empty cache (~1 h on 2 cores; run before changing setup)
	@tools/fresh-check.sh

clean:  ## remove the venv and build outputs (the cache outside the repo stays)
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Each part adds its own targets (and prerequisites of setup/test) here.
-include mk/*.mk
