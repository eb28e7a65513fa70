"""lorafleet_sync."""
