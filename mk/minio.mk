# MinIO for the adapter-source and sync-job tests (issue 4), built from its Go module.
# The release tag RELEASE.2025-10-15T17-29-55Z is not served by the Go module proxy
# reachable here (403 "not available"); the module's final master is, so we pin that.
MINIO_VERSION ?= v0.0.0-20260212201848-7aac2a2c5b7c
MINIO_BIN := $(LORAFLEET_CACHE)/bin/minio-$(MINIO_VERSION)

.PHONY: minio
minio: $(MINIO_BIN)  ## build MinIO (Go module, pinned) into $(LORAFLEET_CACHE)/bin

$(MINIO_BIN):
	@echo "==> building MinIO $(MINIO_VERSION) (first run downloads modules and compiles: 5-20 min)"
	@mkdir -p $(LORAFLEET_CACHE)/bin $(LORAFLEET_CACHE)/minio-build
	@cd $(LORAFLEET_CACHE)/minio-build && \
		GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN=$(LORAFLEET_CACHE)/minio-build/bin \
		nice -n 10 go install -v -trimpath \
		-ldflags "-s -w" \
		github.com/minio/minio@$(MINIO_VERSION) 2>&1 | \
		awk '{n++; if (n % 50 == 0) printf "    ... %d packages compiled (%s)\n", n, $$0; fflush()}'
	@test -x $(LORAFLEET_CACHE)/minio-build/bin/minio || { echo "MinIO build failed" >&2; exit 1; }
	@mv $(LORAFLEET_CACHE)/minio-build/bin/minio $@.tmp && mv $@.tmp $@
	@echo "==> MinIO ready: $@"

setup: minio
