"""Integrations with frameworks, each an extra of its own (`flowlock[django]`)."""
