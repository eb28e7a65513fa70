# Operator at scale: 10,000 DynamoModels over 200 stand-in workers on the local control plane.
# LORAFLEET_BENCH_SMOKE=1 runs 500 models over 20 workers (checks the script; results in bench/smoke/).
.PHONY: bench-operator-scale

BENCH_OPERATOR_SCALE_ARGS ?=

bench-operator-scale: setup  ## operator at scale: cold start, +1/-1 pod, steady CPU, RSS, API requests/min
	$(PY) bench/bench_operator_scale.py $(BENCH_OPERATOR_SCALE_ARGS)
