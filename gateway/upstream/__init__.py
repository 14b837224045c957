"""Upstream services: `Upstream` (upstream.py), the one way the gateway reaches them; replicas,
their streams, discovery, coalescing and the traced send."""
