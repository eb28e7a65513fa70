# Chaos soak: the chart on the local dev cluster under traffic and a seeded fault schedule.
.PHONY: soak soak-kind

SOAK_MINUTES ?= 3
SOAK_SEED ?= 0
SOAK_REPORT ?= soak-report.json
SOAK_ARGS ?=

soak: setup  ## chaos soak on the local cluster (SOAK_MINUTES, default 3; SOAK_SEED to replay; JSON report + timeline PNG)
	SOAK_MINUTES=$(SOAK_MINUTES) SOAK_SEED=$(SOAK_SEED) $(PY) tools/soak.py --report $(SOAK_REPORT) $(SOAK_ARGS)
	@echo "soak: report in $(SOAK_REPORT), timeline in $(basename $(SOAK_REPORT)).png"

SOAK_KIND_REPORT ?= soak-kind-report.jsonl
soak-kind: setup  ## chaos soak on multi-node kind: worker/operator kills, store and API outages, node loss (SOAK_MINUTES, SOAK_SEED)
	rm -f $(SOAK_KIND_REPORT)
	KIND_WORKERS=2 SOAK_MINUTES=$(SOAK_MINUTES) SOAK_SEED=$(SOAK_SEED) LORAFLEET_E2E_REPORT=$(abspath $(SOAK_KIND_REPORT)) \
	  tools/kind-e2e.sh tests/e2e/test_kind_soak.py -rP $(PYTEST_ARGS)
	@echo "soak-kind: one JSON line per fault in $(SOAK_KIND_REPORT)"
