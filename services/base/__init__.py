"""Shared service machinery: the core, the generic servicer, scheduling and the runtime protocol."""
