"""Layouts as the planner sees them: a Config from a model, batch and degrees
(`layout_config`), the fields a prediction is about (`describe`), GPT stacks in Llama
shapes (`gpt_as_llama`), and per-rank sizes the cost and memory models share."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tetrad.config import DTYPE_BYTES, Config, ModelConfig
from tetrad.layout import Layout
from tetrad.mesh import expert_groups
from tetrad.parallel.pipeline.schedules import rank_stages


def layout_of(cfg: Config) -> Layout:
    """A candidate's layout: the planner describes candidates as Configs (a model, a batch,
    degrees); every derived fact of one (local shapes, dtypes, the split) is `Layout`'s.
    Cached by the config's values: a search asks for one candidate's layout dozens of
    times, and validating it was a third of the search."""
    try:
        return _layout(_ByValue(cfg))
    except TypeError:  # a field holds an unhashable value: build it each time
        return Layout.build(cfg)


class _ByValue:
    """A Config hashed and compared by its fields' values as they are now (a later change
    to the config makes a new key, never a stale hit)."""

    __slots__ = ("cfg", "key", "hash")

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.key = tuple(tuple(vars(section).values()) for section in vars(cfg).values())
        self.hash = hash(self.key)  # TypeError here, before the cache sees it

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByValue) and self.key == other.key


@functools.lru_cache(maxsize=8192)
def _layout(keyed: _ByValue) -> Layout:
    return Layout.build(keyed.cfg)


def held_stages(cfg: Config, pp_rank: int) -> tuple[int, ...]:
    """The global stages pp rank `pp_rank` holds (`schedules.rank_stages`; cached: a
    search asks tens of thousands of times for a few dozen placements)."""
    p = cfg.parallel
    return _held_stages(pp_rank, p.pp, p.virtual_stages, p.pp_schedule)


@functools.cache
def _held_stages(pp_rank: int, pp: int, v: int, schedule: str) -> tuple[int, ...]:
    return tuple(rank_stages(pp_rank, pp, v, schedule))


def model_key(model: ModelConfig) -> tuple:
    """`model`'s fields as a key for the planner's caches (its repr cost a search seconds)."""
    return tuple(vars(model).values())


def local_tokens(cfg: Config) -> int:
    """Tokens of one microbatch on one rank: cp splits every sequence."""
    return layout_of(cfg).microbatch_tokens


def cp_exchange_bytes(cfg: Config) -> float:
    """Bytes of keys and values one rank receives per attention layer and microbatch
    under context parallelism (forward; dk and dv the same backward): those of the other
    cp - 1 shards, 2·(cp - 1)/cp · b·s·kv·hd·c, with kv the rank's kv heads."""
    p, m = cfg.parallel, cfg.model
    kv = max(m.kv_heads // p.tp, 1)
    whole = 2 * layout_of(cfg).microbatch_size * cfg.train.seq_len * kv * m.head_dim * cbytes(cfg)
    return (p.cp - 1) / p.cp * whole


def ep_bytes_per_layer(cfg: Config) -> float:
    """All-to-all bytes one rank sends per MoE layer per microbatch under expert
    parallelism, forward and backward (docs/moe.md): 4·T·k·dim·c·(ep - 1)/ep, the
    dispatch and the combine each way, T the tokens the rank dispatches (1/tp of its
    microbatch's under tp), uniform routing. The counts' exchange is not included."""
    p, m = cfg.parallel, cfg.model
    tokens = local_tokens(cfg) / p.tp
    return 4 * tokens * m.top_k * m.dim * cbytes(cfg) * (p.ep - 1) / p.ep


@functools.cache
def _expert_groups(degrees: tuple[tuple[str, int], ...], ep: int) -> tuple[list, list]:
    return expert_groups(dict(degrees), ep)


def ep_groups(cfg: Config) -> tuple[list[list[int]], list[list[int]]]:
    """The ep groups and expert-data groups of `cfg`'s layout, in global ranks
    (`mesh.expert_groups`; cached: a search asks for the same degrees often)."""
    return _expert_groups(tuple(layout_of(cfg).degrees.items()), cfg.parallel.ep)


def cbytes(cfg: Config) -> int:
    """Bytes of one element in the compute dtype."""
    return DTYPE_BYTES[cfg.train.dtype]


def describe(cfg: Config, recompute: str = "none") -> dict[str, Any]:
    """The layout fields of `cfg` a prediction is about."""
    p = cfg.parallel
    return {
        "dp": p.dp, "fsdp": p.fsdp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep,
        "zero_stage": p.zero_stage,
        "sp": p.sp, "pp_schedule": p.pp_schedule, "microbatches": p.microbatches,
        "virtual_stages": p.virtual_stages, "microbatch_size": layout_of(cfg).microbatch_size,
        "global_batch": cfg.train.global_batch, "seq_len": cfg.train.seq_len,
        "dtype": cfg.train.dtype, "recompute": recompute, "world": p.world_size,
    }  # fmt: skip


def gpt_as_llama(layers: int, hidden: int, heads: int, vocab: int, max_seq_len: int) -> ModelConfig:
    """A GPT layer stack (4h GeLU MLP, multi-head attention) in tetrad's Llama shapes: the
    SwiGLU's three h x f matrices with f = 8h/3 (rounded to a multiple of 128) hold the
    GPT MLP's two h x 4h, so matmul FLOPs and parameters match within 1%; kv_heads =
    heads; untied embedding and head. Norms and activations differ (RMSNorm, SiLU)."""
    ffn = 128 * round(8 * hidden / 3 / 128)
    return ModelConfig(
        name=f"gpt-{layers}x{hidden}", layers=layers, dim=hidden, heads=heads, kv_heads=heads,
        vocab=vocab, ffn_dim=ffn, max_seq_len=max_seq_len,
    )  # fmt: skip


def layout_config(model: ModelConfig, global_batch: int, seq_len: int, dtype: str = "bf16",
                  **parallel: Any) -> Config:  # fmt: skip
    """A Config for the planner: `model`, batch, sequence, compute dtype and degrees."""
    cfg = Config()
    cfg.model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, seq_len))
    cfg.data.source = "synthetic"
    cfg.train.global_batch, cfg.train.seq_len, cfg.train.dtype = global_batch, seq_len, dtype
    cfg.parallel = dataclasses.replace(cfg.parallel, **parallel)
    return cfg
