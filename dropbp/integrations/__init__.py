"""Integrations with training frameworks (imported on demand: ``dropbp.integrations.hf``)."""
