"""Parallelism-free models and their sharding plans (data, not code)."""

from tetrad.models.init import build_model, full_shape, full_value, materialize
from tetrad.models.llama import Llama, cross_entropy_sum

__all__ = ["Llama", "build_model", "cross_entropy_sum", "full_shape", "full_value", "materialize"]
