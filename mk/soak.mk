# Chaos soak: the chart on the local dev cluster under traffic and a seeded fault schedule.
.PHONY: soak

SOAK_MINUTES ?= 3
SOAK_SEED ?= 0
SOAK_REPORT ?= soak-report.json
SOAK_ARGS ?=

soak: setup  ## chaos soak on the local cluster (SOAK_MINUTES, default 3; SOAK_SEED to replay; JSON report + timeline PNG)
	SOAK_MINUTES=$(SOAK_MINUTES) SOAK_SEED=$(SOAK_SEED) $(PY) tools/soak.py --report $(SOAK_REPORT) $(SOAK_ARGS)
	@echo "soak: report in $(SOAK_REPORT), timeline in $(basename $(SOAK_REPORT)).png"
