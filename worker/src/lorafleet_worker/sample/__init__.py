"""Sampling: logits processors, penalties and the sampler."""
