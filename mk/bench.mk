# Benchmarks (issue 8): they report, they never fail CI. Results go to bench/*.json, bench/REPORT.md, PNGs.
.PHONY: bench bench-engine bench-loading bench-placement bench-operator bench-report

bench: setup bench-placement bench-loading bench-engine bench-operator bench-report  ## run every benchmark, write bench/REPORT.md

bench-engine: setup-python  ## lorafleet vs transformers+PEFT (concurrency 1/8/32/64)
	$(PY) bench/bench_engine.py

bench-loading: setup  ## adapter load latency: cold (MinIO), warm (disk), hot (CPU -> slot)
	$(PY) bench/bench_loading.py

bench-placement: setup-python  ## HRW placement: 10,000 adapters x 200 pods, incremental add
	$(PY) bench/bench_placement.py

bench-operator: setup  ## kubectl apply -> Ready for 1, 50, 200 DynamoModels on 5 workers
	-$(PY) bench/bench_operator.py

bench-report: setup-python  ## bench/REPORT.md and plots from the JSON results
	$(PY) bench/report.py
