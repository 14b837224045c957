"""Per-tenant quotas: pure token-bucket maths (bucket.py) and the stores that hold the state."""
