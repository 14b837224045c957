"""Ensembles run by the gateway: plan.py compiles Triton's ensemble_scheduling into a validated
DAG (pure), executor.py runs it over the upstream services."""
