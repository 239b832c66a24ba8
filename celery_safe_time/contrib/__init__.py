"""Optional integrations kept apart from the core (import them only when used)."""
