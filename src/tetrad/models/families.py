"""The model families tetrad knows, by name: how parallel code finds a model's spec."""

from __future__ import annotations

from tetrad.config import ModelConfig
from tetrad.models.deepseek_spec import DEEPSEEK_V3
from tetrad.models.llama_spec import LLAMA, MISTRAL, QWEN2, QWEN3
from tetrad.models.moe_spec import MOE
from tetrad.models.spec import ModelSpec

FAMILIES: dict[str, ModelSpec] = {
    spec.family: spec for spec in (LLAMA, MISTRAL, QWEN2, QWEN3, MOE, DEEPSEEK_V3)
}


def family(name: str) -> ModelSpec:
    """The spec of family `name`, or a ValueError listing the known ones."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def spec_for(model: ModelConfig) -> ModelSpec:
    """The spec of the family `model` belongs to (`ModelConfig.family`)."""
    return family(model.family)
