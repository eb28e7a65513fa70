# Benchmarks: they report, they never fail CI. Results go to bench/*.json, bench/REPORT.md and PNGs (bench/README.md).
# LORAFLEET_BENCH_SMOKE=1 runs any of them on a ~1M-parameter model and writes to bench/smoke/ instead.
# BENCH_ENGINE_ARGS narrows the engine run, e.g. BENCH_ENGINE_ARGS="--concurrency 1 8 32 --scenarios base mixed16".
.PHONY: bench bench-prefix bench-engine bench-structured bench-spec bench-dtype bench-loading bench-on-demand bench-placement bench-operator bench-report bench-profile bench-micro bench-smoke

BENCH_ENGINE_ARGS ?=
BENCH_PROFILE_ARGS ?= --scenario mixed16 --concurrency 32

bench: setup bench-placement bench-loading bench-micro bench-engine bench-dtype bench-operator bench-prefix bench-report  ## run every benchmark, write bench/REPORT.md

bench-prefix: setup-python  ## prefix caching on/off (multi-turn chat, 16 adapters) and cache-aware vs fewest-in-flight routing
	$(PY) bench/bench_prefix.py

bench-engine: setup-python  ## lorafleet vs transformers+PEFT (concurrency 1/8/32/64), random + real model, roofline
	$(PY) bench/bench_engine.py $(BENCH_ENGINE_ARGS)

# What `--dtype auto` picks on a CPU (worker devices.py) is decided by this row: bf16 vs fp32 side by side.
bench-dtype: setup-python  ## fp32 vs bf16 on this CPU, base and real model, concurrency 32 (merged into bench/engine.json)
	$(PY) bench/bench_engine.py --merge --scenarios base real-base --concurrency 32 --dtype float32 bfloat16

bench-structured: setup-python  ## JSON-schema workload vs the same prompts unconstrained (c=32), mask and compile times
	$(PY) bench/bench_structured.py

bench-spec: setup-python  ## n-gram speculative decoding and jump-forward on/off, interleaved: one user (grounded, JSON), c=32
	$(PY) bench/bench_spec.py

bench-loading: setup  ## adapter load latency: cold (MinIO), warm (disk), hot (CPU -> slot)
	$(PY) bench/bench_loading.py

BENCH_ON_DEMAND_ARGS ?=

bench-on-demand: setup  ## TTFT of a request for an adapter not held (catalogue -> MinIO -> load) vs warm (BENCH_ON_DEMAND_ARGS)
	$(PY) bench/bench_on_demand.py $(BENCH_ON_DEMAND_ARGS)

bench-placement: setup-python  ## HRW placement: 10,000 adapters x 200 pods, incremental add
	$(PY) bench/bench_placement.py

bench-operator: setup  ## kubectl apply -> Ready for 1, 50, 200 DynamoModels on 5 workers
	-$(PY) bench/bench_operator.py

bench-report: setup-python  ## bench/REPORT.md and plots from the JSON results
	$(PY) bench/report.py

bench-profile: setup-python  ## where a lorafleet engine step spends its time (BENCH_PROFILE_ARGS)
	$(PY) bench/profile_engine.py $(BENCH_PROFILE_ARGS) --torch-profile

bench-micro: setup-python  ## the torch LoRA backend on one mixed16 decode step vs its matmul-only floor
	$(PY) bench/micro_lora.py

bench-smoke: setup  ## every benchmark on a tiny model, results in bench/smoke/ (checks the scripts)
	LORAFLEET_BENCH_SMOKE=1 $(PY) bench/bench_placement.py --adapters 200 --pods 20
	LORAFLEET_BENCH_SMOKE=1 $(PY) bench/bench_loading.py --repeats 3
	LORAFLEET_BENCH_SMOKE=1 $(PY) bench/bench_engine.py --concurrency 1 8 --scenarios base mixed16 real-base real-qv16 \
		--breakdown-concurrency 8
	LORAFLEET_BENCH_SMOKE=1 $(PY) bench/report.py
