"""lorafleet_operator."""
