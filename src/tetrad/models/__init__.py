"""Parallelism-free models and their sharding plans (data, not code)."""
