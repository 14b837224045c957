"""Routing: model/version -> replicas (pure, no I/O)."""
