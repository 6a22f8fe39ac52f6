"""Adapters from FreeToken models to agent frameworks."""
