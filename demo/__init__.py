"""`make demo`: lorafleet end to end on this machine (see demo/run_demo.py)."""
