"""Upstream services: channels, replicas, discovery."""
