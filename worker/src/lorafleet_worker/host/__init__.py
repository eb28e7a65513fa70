"""The machine the worker runs on: devices, CPU threads and huge pages."""
