# Worker targets: the single-worker demo.
.PHONY: demo-worker

demo-worker: setup-python  ## one worker, a tiny generated model, two adapters; prints each answer
	$(PY) -m lorafleet_worker_dev.demo $(if $(DEMO_WORKDIR),--workdir $(DEMO_WORKDIR),)
