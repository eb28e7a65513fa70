# lorafleet side by side with llama.cpp's llama-server(bench/bench_peers.py). Not part of setup or test:
# the first run builds llama-server and llama-quantize from the hash-pinned llama-cpp-python sdist (several minutes;
# cached in $(LORAFLEET_CACHE)/llama.cpp-<version>/, log build.log there) and writes the GGUFs beside them.
# BENCH_PEERS_ARGS narrows the run, e.g. BENCH_PEERS_ARGS="--pairs f32:F32 --scenarios base one --concurrency 1".
.PHONY: bench-peers llama-cpp

BENCH_PEERS_ARGS ?=

llama-cpp:  ## build llama.cpp's llama-server + llama-quantize from the pinned llama-cpp-python sdist (cached)
	@tools/build-llama-cpp.sh >/dev/null

bench-peers: setup-python model  ## lorafleet vs llama.cpp llama-server, c = 1/8/32, f32/bf16/int8 (bench/peers.json)
	$(PY) bench/bench_peers.py $(BENCH_PEERS_ARGS)
	$(PY) bench/report.py

bench: bench-peers
