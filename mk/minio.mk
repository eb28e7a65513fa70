# MinIO for the adapter-source and sync-job tests, built from its Go module.
# The release tag RELEASE.2025-10-15T17-29-55Z is not served by the Go module proxy
# reachable here (403 "not available"); the module's final master is, so we pin that.
# A `minio` on PATH built from the same commit is used instead of building (setup says so).
MINIO_VERSION ?= v0.0.0-20260212201848-7aac2a2c5b7c
MINIO_COMMIT := $(lastword $(subst -, ,$(MINIO_VERSION)))
MINIO_BIN := $(LORAFLEET_CACHE)/bin/minio-$(MINIO_VERSION)
MINIO_LOG := $(LORAFLEET_CACHE)/minio-build/build.log

.PHONY: minio
minio: $(MINIO_BIN)  ## build MinIO (Go module, pinned) into $(LORAFLEET_CACHE)/bin

$(MINIO_BIN):
	@mkdir -p $(LORAFLEET_CACHE)/bin $(LORAFLEET_CACHE)/minio-build
	@found="$$(command -v minio || true)"; \
	if [ -n "$$found" ] && "$$found" --version 2>/dev/null | grep -q "commit-id=$(MINIO_COMMIT)"; then \
		ln -sf "$$(readlink -f "$$found")" $@; echo "==> MinIO $(MINIO_VERSION): using $$found (already on this machine)"; exit 0; \
	fi; \
	echo "==> building MinIO $(MINIO_VERSION) (first run downloads modules and compiles: 5-20 min; log: $(MINIO_LOG))"; \
	cd $(LORAFLEET_CACHE)/minio-build && \
	{ GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN=$(LORAFLEET_CACHE)/minio-build/bin \
		nice -n 10 go install -v -trimpath -ldflags "-s -w" github.com/minio/minio@$(MINIO_VERSION) 2>&1; \
		echo "exit $$?"; } | tee $(MINIO_LOG) | \
		awk '{n++; if (n % 50 == 0) printf "    ... %d packages compiled (%s)\n", n, $$0; fflush()}'; \
	if ! tail -n 1 $(MINIO_LOG) | grep -qx "exit 0" || [ ! -x bin/minio ]; then \
		echo "==> MinIO build FAILED; last 50 lines of $(MINIO_LOG):" >&2; tail -n 50 $(MINIO_LOG) >&2; \
		echo "==> full log: $(MINIO_LOG)" >&2; exit 1; \
	fi; \
	mv bin/minio $@.tmp && mv $@.tmp $@ && echo "==> MinIO ready: $@"

setup: minio
