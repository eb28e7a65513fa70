"""lorafleet_worker."""
