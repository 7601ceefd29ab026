"""Optional integrations with other tools, each behind its own extra."""
