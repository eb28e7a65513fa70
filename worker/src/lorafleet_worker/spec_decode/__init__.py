"""Speculative decoding: its configuration and the draft proposers (the verify rule is in sample/rejection.py)."""
