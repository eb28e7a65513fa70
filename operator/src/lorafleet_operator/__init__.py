"""lorafleet's DynamoModel operator: places LoRA adapters on worker pods and loads them there."""
