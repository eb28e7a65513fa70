"""The HTTP layer: the OpenAI-compatible and LoRA management apps, request validation and response shapes."""
