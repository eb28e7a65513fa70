"""lorafleet's router: an OpenAI-compatible front that sends each request to a worker pod holding its model."""
