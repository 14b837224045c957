"""Metrics and tracing shared by every process."""
