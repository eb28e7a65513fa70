"""lorafleet's worker management API for a vLLM server, run beside it in its pod (``lorafleet-vllm-sidecar``)."""
