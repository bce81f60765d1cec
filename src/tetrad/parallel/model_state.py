"""Model-state memory per rank, exactly: predicted from a config, measured from a run.

Model state is what persists between steps: parameters, gradients and optimizer state.
`model_state_bytes(layout, model, rank)` predicts it without processes, from the same unit layout
the ZeRO runtime shards by (so padding and the optimizer's tensor count are exact);
`measured_model_state(engine, optimizer)` adds up the live storages behind the same
three categories; the two agree to the byte.

Categories follow the ZeRO paper's convention. "params" are the compute parameters
(bf16 in mixed precision); the fp32 master copy counts as optimizer state unless compute
is fp32 too, when it *is* the parameters. So full fp32 training is 4+4+8 bytes per
parameter and mixed precision 2+2+12, and over N sharding ranks (`zero_formula_bytes`):
ZeRO-1 (p+g)Ψ + KΨ/N, ZeRO-2 pΨ + (g+K)Ψ/N, ZeRO-3 (p+g+K)Ψ/N, with Ψ the local parameter
count. tetrad matches these in fp32 up to padding (each unit padded to a multiple of N)
and AdamW's 4-byte step counter per optimizer tensor. In mixed precision it keeps the
sharded gradient in fp32 (the master weights' dtype), 4Ψ/N where the paper counts 2Ψ/N;
and ZeRO-1 keeps it beside the full bf16 gradient (+4Ψ/N); ZeRO-3 holds no persistent
bf16 parameter shard (compute copies are cast from the master at gather time), so its
total is the paper's 16Ψ/N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tetrad.config import ModelConfig
from tetrad.layout import Layout
from tetrad.mesh import Mesh
from tetrad.models.families import spec_for
from tetrad.models.spec import ModelSpec
from tetrad.parallel.compress import piece_sizes
from tetrad.parallel.data import bucket_spans
from tetrad.parallel.expert import REPLICATED as EXPERT_REPLICATED
from tetrad.parallel.groups import ParamGroup, param_groups
from tetrad.parallel.local import planned
from tetrad.parallel.zero import UnitSlots, plan_units
from tetrad.precision import mixed, wide

STEP_BYTES = 4  # AdamW's per-tensor step counter: a float32 scalar
ADAM_BYTES = 8  # exp_avg and exp_avg_sq in fp32, per element
MASTER_BYTES = 4  # fp32 master weights and the sharded fp32 gradient
# under fp64 (verification) masters, their gradients and AdamW are float64: twice these


def _wide_bytes(dtype: torch.dtype) -> tuple[int, int]:
    """(master or wide-gradient bytes, AdamW bytes) per element beside compute `dtype`."""
    scale = wide(dtype).itemsize // 4
    return MASTER_BYTES * scale, ADAM_BYTES * scale


@dataclass(frozen=True)
class ModelState:
    """Bytes of one rank's model state, by category."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: ModelState) -> ModelState:
        return ModelState(*(a + b for a, b in zip(self.parts, other.parts)))

    @property
    def parts(self) -> tuple[int, int, int]:
        """(params, grads, optimizer): `dataclasses.astuple`'s, without its deep copies."""
        return self.params, self.grads, self.optimizer


# --- prediction ---------------------------------------------------------------------------


def local_parameters(
    layout: Layout, m: ModelConfig, rank: int
) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, tuple[str, ...]]]:
    """Names and shapes of the parameters `rank` holds after the pipeline split and tensor
    parallelism, and the axes each is replicated over (pure: the meta-device model)."""
    local = planned(layout, m, rank)
    return [(n, tuple(p.shape)) for n, p in local.model.named_parameters()], local.replicated


def zero_bytes(
    layouts: list[UnitSlots], fsdp_rank: int, stage: int, dtype: torch.dtype
) -> ModelState:
    """Model state of fsdp rank `fsdp_rank` for these units, ZeRO `stage`, compute `dtype`."""
    c, two = dtype.itemsize, mixed(dtype)
    master, adam = _wide_bytes(dtype)
    padded = sum(u.padded for u in layouts)
    shard = sum(u.shard for u in layouts)
    views = [v for u in layouts for v in u.views(fsdp_rank)]
    elements = sum(v.stop - v.start for v in views)  # the shard less its padding
    full_params = padded * c if stage < 3 else 0
    # fp32 compute: the master shard is the parameters (a slice of them below stage 3)
    master_params = shard * master if stage == 3 and not two else 0
    full_grads = padded * c if stage == 1 else 0
    # stage 1 in fp32 reduces in place: the sharded gradient is a slice of the full one
    shard_grads = 0 if stage == 1 and not two else shard * master
    optimizer = adam * elements + STEP_BYTES * len(views)
    optimizer += shard * master if two else 0
    return ModelState(full_params + master_params, full_grads + shard_grads, optimizer)


def replicated_bytes(
    named_shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype = torch.float32
) -> ModelState:
    """Plain data parallelism (fsdp = 1): parameters, gradients and AdamW, unsharded.

    fp32: 4 + 4 + 8 bytes per parameter. Mixed precision: compute parameters and their
    accumulated gradients in `dtype` (2 + 2), the fp32 gradients the optimizer reads
    (+4, alive from the reduction to the next step's zero_grad), the fp32 masters and
    AdamW (4 + 8): 20 bytes, where the ZeRO paper's 2 + 2 + 12 has no fp32 gradient."""
    psi = sum(math.prod(s) for _, s in named_shapes)
    master, adam = _wide_bytes(dtype)
    optimizer = adam * psi + STEP_BYTES * len(named_shapes)
    c = dtype.itemsize
    # mixed precision: the fp32 gradients and the fp32 masters (fp32, fp64: neither)
    wide_copy = master * psi if mixed(dtype) else 0
    return ModelState(c * psi, c * psi + wide_copy, optimizer + wide_copy)


def model_state_bytes(layout: Layout, m: ModelConfig, rank: int = 0) -> ModelState:
    """Exact model-state bytes of global `rank` of model `m` under `layout` (pure)."""
    named, replicated = local_parameters(layout, m, rank)
    mesh = Mesh.plan(layout.degrees, rank, layout.ep)
    groups = param_groups(
        [n for n, _ in named],
        expert_names(replicated),
        layout.zero_stage,
        layout.degrees["fsdp"],
        mesh["ep_data"].size,
    )
    return groups_state(groups, named, replicated, layout, m, lambda g: mesh[g.axis].rank)


def groups_state(groups, named, replicated, layout: Layout, m: ModelConfig, shard_rank):
    """The model state of the local parameters `named` (shapes) in parameter `groups`: each
    group's bytes at its shard `shard_rank(group)`, and a compressed reduction's residuals
    (the runtime's rank, or the planner's shard 0)."""
    spec, dtype = spec_for(m), layout.compute_dtype
    states = (group_bytes(g, named, replicated, shard_rank(g), spec, dtype) for g in groups)
    residuals = sum(residual_bytes(g, named, replicated, layout, spec) for g in groups)
    return sum(states, ModelState(0, residuals, 0))


def residual_bytes(
    group: ParamGroup,
    named: list[tuple[str, tuple[int, ...]]],
    replicated: dict[str, tuple[str, ...]],
    layout: Layout,
    spec: ModelSpec,
) -> int:
    """A compressed reduction's fp32 error-feedback residuals for one group, counted with
    the gradients (parallel/compress.py): per ZeRO unit, the sender's over every rank's
    piece; per dp bucket, that and the summing rank's piece; none without compression or
    feedback. Buckets as `GradBuckets` makes them, with the layout's first bucket (its CPU
    default when unset: on a GPU the first bucket's padding may differ by a block per
    rank). The runtime and the planner alike."""
    if not (layout.compress and layout.error_feedback):
        return 0
    mine = group.of(named)
    if group.sharded:
        units = plan_units(mine, replicated, group.shards, spec, group.axis)
        return sum(4 * group.shards * piece_sizes(u.padded, group.shards)[1] for u in units)
    ranks = layout.data if group.data == "data" else layout.expert_data
    if ranks == 1:
        return 0
    numels = [math.prod(shape) for _, shape in mine]
    c = layout.compute_dtype.itemsize
    first = layout.first_bucket_bytes or layout.bucket_bytes
    spans = bucket_spans([n * c for n in numels], first, layout.bucket_bytes)
    widths = [piece_sizes(sum(numels[i] for i in span), ranks)[1] for span in spans]
    return sum(4 * (ranks + 1) * w for w in widths)


def group_bytes(
    group: ParamGroup,
    named: list[tuple[str, tuple[int, ...]]],
    replicated: dict[str, tuple[str, ...]],
    shard_rank: int,
    spec: ModelSpec,
    dtype: torch.dtype,
) -> ModelState:
    """Model state of one parameter group's share of `named` (name, shape): its ZeRO units
    on shard `shard_rank` of the group's shards, or, held whole, unsharded."""
    mine = group.of(named)
    if not group.sharded:
        return replicated_bytes(mine, dtype)
    units = plan_units(mine, replicated, group.shards, spec, group.axis)
    return zero_bytes(units, shard_rank, group.stage, dtype)


def expert_names(replicated: dict[str, tuple[str, ...]]) -> set[str]:
    """The expert weights among local parameters: those replicated over ep_data alone."""
    return {n for n, axes in replicated.items() if axes == EXPERT_REPLICATED}


def zero_formula_bytes(
    psi: float, n: int, stage: int, param: float = 2, grad: float = 2, k: float = 12
) -> ModelState:
    """The ZeRO paper's model state per device (stage 0: plain data parallelism): stage s
    shards the optimizer state from 1, the gradients from 2, the parameters at 3."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    sharded = (stage >= 3, stage >= 2, stage >= 1)
    return ModelState(*(b * psi / n if s else b * psi for b, s in zip((param, grad, k), sharded)))


# --- measurement --------------------------------------------------------------------------


def measured_model_state(engine, optimizer: torch.optim.Optimizer) -> ModelState:
    """The bytes of the live tensors behind `engine`'s model state and `optimizer`'s."""
    seen: set[int] = set()

    def size(*tensors: torch.Tensor | None) -> int:
        """Bytes of the storages behind `tensors` not counted yet (views of one buffer, or
        a buffer already counted in another category, count once; freed ones not at all)."""
        storages = [t.untyped_storage() for t in tensors if t is not None]
        new = {
            s.data_ptr(): s.nbytes() for s in storages if s.nbytes() and s.data_ptr() not in seen
        }
        seen.update(new)
        return sum(new.values())

    state = [
        t
        for _, p in engine.named_parameters()
        for t in optimizer.state.get(p, {}).values()
        if isinstance(t, torch.Tensor)
    ]
    held = engine.grads.held()
    params, grads = size(*held.params), size(*held.grads)
    return ModelState(params, grads, size(*held.masters, *state))


def measure_at_each_step(engine, optimizer: torch.optim.Optimizer) -> list[ModelState]:
    """From now on, measure the model state at every optimizer step (just after it, when
    parameters, gradients and optimizer state are all alive); returns the growing list."""
    found: list[ModelState] = []
    engine.on_step(lambda: found.append(measured_model_state(engine, optimizer)))
    return found
