"""Layouts as the planner sees them: a `Layout` from a model, batch and degrees
(`layout_for`, `candidate`: `Layout.of` of the model, its training settings and the
degrees, no `Config`), the fields a prediction is about (`describe`), GPT stacks in Llama
shapes (`gpt_as_llama`), and per-rank sizes the cost and memory models share. Every
planner function takes a `Layout` (frozen and hashable: its caches' key) and the
`ModelConfig`, never the whole `Config`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

from tetrad.config import ModelConfig, ParallelConfig, TrainConfig, check_model_and_train
from tetrad.layout import Layout, dtype_name
from tetrad.mesh import ep_spans_tp
from tetrad.parallel.pipeline.schedules import rank_stages

T = TypeVar("T")


def held_stages(lay: Layout, pp_rank: int) -> tuple[int, ...]:
    """The global stages pp rank `pp_rank` holds (`schedules.rank_stages`; cached: a
    search asks tens of thousands of times for a few dozen placements)."""
    return _held_stages(pp_rank, lay.pp, lay.virtual_stages, lay.schedule)


@functools.cache
def _held_stages(pp_rank: int, pp: int, v: int, schedule: str) -> tuple[int, ...]:
    return tuple(rank_stages(pp_rank, pp, v, schedule))


def block_kinds(m: ModelConfig, split: list[int], stages: list[int]) -> tuple[int, int]:
    """(dense, MoE) blocks a rank holding global `stages` has: an MoE model's first
    `dense_layers` blocks are dense (Llama's SwiGLU); a dense model's are all dense."""
    starts = list(itertools.accumulate(split, initial=0))
    held = sum(split[s] for s in stages)
    if not m.moe:
        return held, 0
    dense = sum(max(0, min(starts[s + 1], m.dense_layers) - starts[s]) for s in stages)
    return dense, held - dense


def model_key(model: ModelConfig) -> tuple:
    """`model`'s fields' values, in the fields' order, as a key for the planner's caches (its
    repr cost a search seconds; `_candidate` builds the model back from it)."""
    return tuple(vars(model).values())


def cached(cache: dict[Any, T], key: Any, make: Callable[..., T], *args: Any) -> T:
    """`cache[key]`, made by `make(*args)` the first time it is asked for (the planner's
    caches, each keyed by what its values read)."""
    if key not in cache:
        cache[key] = make(*args)
    return cache[key]


def cp_exchange_bytes(lay: Layout, m: ModelConfig) -> float:
    """Bytes of keys and values one rank receives per attention layer and microbatch
    under context parallelism (forward; dk and dv the same backward): those of the other
    cp - 1 shards, 2·(cp - 1)/cp · b·s·kv·hd·c, with kv the rank's kv heads."""
    kv = lay.kv_heads(m.kv_heads)
    whole = 2 * lay.microbatch_size * lay.seq_len * kv * m.head_dim * lay.element_bytes
    return (lay.cp - 1) / lay.cp * whole


def ep_bytes_per_layer(lay: Layout, m: ModelConfig) -> float:
    """All-to-all bytes one rank sends per MoE layer per microbatch under expert
    parallelism, forward and backward (docs/moe.md): 4·T·k·dim·c·(ep - 1)/ep, the
    dispatch and the combine each way, T the tokens the rank dispatches (1/tp of its
    microbatch's under tp), uniform routing. The counts' exchange is not included."""
    tokens = lay.microbatch_tokens / lay.tp
    return 4 * tokens * m.top_k * m.dim * lay.element_bytes * (lay.ep - 1) / lay.ep


def first_ep_groups(lay: Layout) -> tuple[list[int], list[int]]:
    """The first ep group and the first expert-data group of `lay` (global ranks; every
    group is priced alike): `mesh.expert_groups`' first of each, found on the first
    pipeline stage alone (pp is the outermost axis, so its ranks and groups are those of
    `lay` at pp 1), which a search of many pp degrees asks once."""
    d = lay.degrees
    return _first_ep_groups(d["dp"], d["fsdp"], d["cp"], d["tp"], lay.ep)


@functools.cache
def _first_ep_groups(dp: int, fsdp: int, cp: int, tp: int, ep: int) -> tuple[list, list]:
    """`mesh.expert_groups`' first ep group and first expert-data group of one stage, by
    its rank arithmetic without listing every group (listing them was 10 ms a degree set,
    2,000 of them in a 256-GPU search; tests/test_plan_speed.py holds the two equal). A
    rank is ((dp·fsdp + fsdp)·cp + cp)·tp + tp by coordinate; its data index b (fsdp
    fastest, then dp, then cp) puts it in ep group b // width, with its tp rank unless the
    group spans tp. Every group's first rank is its smallest: the first expert-data
    group is those, ascending."""
    spans = ep_spans_tp(dp * fsdp * cp, ep)
    width = ep // tp if spans else ep

    def base(b: int) -> int:  # the rank at data index b, tp rank 0
        f, rest = b % fsdp, b // fsdp
        return ((rest % dp * fsdp + f) * cp + rest // dp) * tp

    lowest = [min(base(b) for b in range(q, q + width)) for q in range(0, dp * fsdp * cp, width)]
    if spans:
        return sorted(base(b) + t for b in range(width) for t in range(tp)), sorted(lowest)
    return sorted(base(b) for b in range(width)), sorted(q + t for q in lowest for t in range(tp))


def describe(lay: Layout, recompute: str = "none") -> dict[str, Any]:
    """The layout fields of `lay` a prediction is about."""
    d = lay.degrees
    return {
        "dp": d["dp"], "fsdp": d["fsdp"], "tp": d["tp"], "pp": d["pp"], "cp": d["cp"],
        "ep": lay.ep, "zero_stage": lay.zero_stage,
        "sp": lay.sp, "pp_schedule": lay.schedule, "microbatches": lay.microbatches,
        "virtual_stages": lay.virtual_stages, "microbatch_size": lay.microbatch_size,
        "global_batch": lay.global_batch, "seq_len": lay.seq_len,
        "dtype": lay.dtype_name, "recompute": recompute, "world": lay.world,
        "fp8": lay.fp8, "reduce_dtype": lay.compress or dtype_name(lay.reduce_dtype),
        "error_feedback": lay.error_feedback, "fp8_all_gather": lay.fp8_all_gather,
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


def layout_for(model: ModelConfig, global_batch: int, seq_len: int, dtype: str = "bf16",
               world: int | None = None, fp8: str = "", **parallel: Any) -> Layout:  # fmt: skip
    """The validated Layout of `model`, batch, sequence, compute dtype (and FP8 recipe) and
    degrees: the model and training settings checked (`config.check_model_and_train`),
    then the layout's own rules (`Layout.of`); ValueError naming what fails."""
    model, train = _sections(model, global_batch, seq_len, dtype, fp8)
    check_model_and_train(model, train)
    return Layout.of(model, train, ParallelConfig(**parallel), world)


def _sections(model: ModelConfig, global_batch: int, seq_len: int, dtype: str, fp8: str,
              loss_chunk: int | None = None) -> tuple[ModelConfig, TrainConfig]:  # fmt: skip
    """The model (long enough for the sequence) and the training settings a Layout reads."""
    train = TrainConfig(global_batch=global_batch, seq_len=seq_len, dtype=dtype, fp8=fp8)
    if loss_chunk is not None:
        train.loss_chunk = loss_chunk
    return dataclasses.replace(model, max_seq_len=max(model.max_seq_len, seq_len)), train


def candidate(base: Layout, model: ModelConfig, **parallel: Any) -> Layout:
    """A search's candidate: `base`'s batch, sequence, dtypes and loss chunk on the given
    degrees, validated for their world (`Layout.build`: ValueError naming what fails).
    Cached by the model and the candidate's values: a search asks for one candidate's
    layout several times, and validating it was a third of the search."""
    return _candidate(model_key(model), base, tuple(sorted(parallel.items())))


@functools.lru_cache(maxsize=1 << 16)  # a 256-GPU MoE search validates 20,000
def _candidate(model: tuple, base: Layout, parallel: tuple) -> Layout:
    """`candidate`, `model` given by its fields' values as they are now (`model_key`, in
    the fields' order: a ModelConfig is mutable, so unhashable)."""
    given = dict(parallel)
    # the FP8 all-gather where the candidate gathers ZeRO-3 shards of whole weights
    gathers = given.get("zero_stage") == 3 and given.get("fsdp", 1) > 1 and given.get("tp", 1) == 1
    given["fp8_all_gather"] = base.fp8_all_gather and gathers
    m, train = _sections(ModelConfig(*model), base.global_batch, base.seq_len, base.dtype_name,
                         base.fp8, base.loss_chunk)  # fmt: skip
    parallel = ParallelConfig(**_carried(base) | given)
    return Layout.of(m, train, parallel, parallel.world)


def _carried(base: Layout) -> dict[str, Any]:
    """The parallel settings a candidate keeps from `base` (all but the degrees, the
    schedule and the counts the search chooses)."""
    reduce = "fp32" if base.dtype_name == "fp64" else dtype_name(base.reduce_dtype)
    return {
        "reduce_dtype": base.compress or reduce, "error_feedback": base.error_feedback,
        "cp_attention": base.cp_attention, "cp_kernel": base.cp_kernel,
        "bucket_mb": base.bucket_bytes / 2**20, "first_bucket_mb": base.first_bucket_bytes / 2**20,
        "reshard_after_forward": base.reshard_after_forward,
        "pp_split": "measured" if base.split_measured else "",
    }  # fmt: skip
