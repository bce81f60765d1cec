"""`parallelize`: build the model for this rank's place in the mesh, and its engine."""

from __future__ import annotations

import torch

from tetrad.comm import Comm
from tetrad.config import ModelConfig, TrainConfig
from tetrad.layout import Layout
from tetrad.mesh import Group, Mesh
from tetrad.models.families import spec_for
from tetrad.models.fp8 import use_fp8
from tetrad.models.init import materialize
from tetrad.models.loss import ChunkedCrossEntropy
from tetrad.models.spec import ModelSpec
from tetrad.parallel.compress import max_over
from tetrad.parallel.data import GradBuckets, LocalGrads, TiedGrads, first_bucket_bytes
from tetrad.parallel.engine import Engine
from tetrad.parallel.groups import GroupedGrads, ParamGroup, param_groups
from tetrad.parallel.local import local_model
from tetrad.parallel.pipeline.runtime import PipelineRuntime, tied_across_stages
from tetrad.parallel.runner import GradSync, MicrobatchLoop, Runner, loss_for
from tetrad.parallel.state_adapter import PlainAdapter
from tetrad.parallel.zero import ZeroShards
from tetrad.parallel.zero_adapter import ZeroAdapter


def parallelize(
    layout: Layout,
    model_cfg: ModelConfig,
    train: TrainConfig,
    mesh: Mesh,
    comm: Comm,
    device: torch.device,
) -> Engine:
    """Build, shard and materialise the model; return the engine that runs its steps.

    `train` gives the seed and the memory settings (recomputation, loss chunk, meter).

    The order is fixed, each step working on what the one before left:
      1. build the whole model on the meta device (no memory);
      2. pipeline split: keep only this stage's layers (pp);
      3. tensor parallelism: shrink each planned linear/embedding to its tp slice;
      4. materialise: fill each local tensor with its slice of the layout-invariant init;
         with --fp8, the blocks' linears become FP8 ones (the same parameters);
      5. the model's memory settings (recomputation; a chunked loss that applies the
         head itself), then the runner: the pipeline schedule (its split backward rewires
         linears), or the plain microbatch loop;
      6. data parallelism last, over the final local parameters, one parameter group at a
         time (dense, then expert weights: `groups`): ZeRO shards (fsdp) or bucketed
         all-reduce (dp), and the matching state adapter. Either one owns the mixed
         precision: compute parameters in `train.dtype` (cast here, from the fp32
         values just materialised, which become the fp32 master weights). fp64 verifies:
         materialised in float64, it has no masters (tetrad.precision).
    """
    if mesh.ep != layout.ep:
        raise ValueError(f"the mesh has ep={mesh.ep} groups, the layout ep={layout.ep}")
    spec = spec_for(model_cfg)
    local = local_model(layout, model_cfg, mesh, comm)  # 1-3
    model, tp = local.model, local.tp
    unshard, slicer = (tp.unshard, tp.slicer) if tp else (None, None)
    if local.ep:  # the expert weights: this rank's experts, joined over ep
        unshard, slicer = local.ep.unshard(unshard), local.ep.slicer(slicer)
    materialize(model, model_cfg, train.seed, device, slicer, layout.master_dtype)
    if layout.fp8:  # the same parameters, in modules whose matmuls run in FP8
        tokens = max_over(comm, mesh["cp"]) if layout.cp > 1 else None  # split over cp
        use_fp8(model, spec.blocks, layout.fp8, tokens)
    spec.set_recompute(model, train.recompute)
    if train.compile:  # each block's body (its hooks and collectives stay eager)
        for block in model.get_submodule(spec.blocks).values():
            block.compile(dynamic=False)
    loss_fn = loss_for(model, train.loss_chunk, tp)
    if train.compile and isinstance(loss_fn, ChunkedCrossEntropy):  # the head fused with
        loss_fn.compile(dynamic=False)  # the loss; tp's vocabulary-parallel one stays eager
    replicated = local.replicated
    runner: Runner = MicrobatchLoop(model, loss_fn, meter_every=train.meter_every)
    if local.chunks is not None:
        runner = PipelineRuntime(
            model, layout, mesh, comm, local.chunks, loss_fn, model_cfg.dim, train.meter_every, spec
        )
        embed = spec.tied_weight
        if model_cfg.tie_embeddings and embed in replicated:  # held by both ends
            replicated[embed] = (*replicated[embed], "pp")  # counted once: on pp rank 0
    # first and last stage each hold the tied embedding: their gradients are summed
    tied_ends = tied_across_stages(layout, model_cfg.tie_embeddings, mesh)
    tied = (spec.tied_weight, mesh["pp_ends"]) if tied_ends else None
    where = (layout, model_cfg, mesh, comm, unshard, slicer)
    experts = local.ep.rows if local.ep else {}  # the expert weights' names
    names = [n for n, _ in model.named_parameters()]
    fsdp, ep_data = layout.degrees["fsdp"], mesh["ep_data"].size
    groups = param_groups(names, experts, layout.zero_stage, fsdp, ep_data)
    syncs, replicated = _group_syncs(groups, model, layout, mesh, comm, replicated, spec, tied)
    sharded = [s for s in syncs if isinstance(s, ZeroShards)]
    grads: GradSync = syncs[0] if len(syncs) == 1 else GroupedGrads(syncs)
    whole = [pair for s in syncs if not isinstance(s, ZeroShards) for pair in s.params()]
    if sharded:
        state: PlainAdapter = ZeroAdapter(sharded, model, *where, whole)
    else:
        state = PlainAdapter(model, *where, whole)
        if tied is not None:
            grads = TiedGrads(grads, *tied, comm)
    return Engine(model, mesh, comm, runner, grads, state, replicated)


def _group_syncs(
    groups: list[ParamGroup],
    model: torch.nn.Module,
    layout: Layout,
    mesh: Mesh,
    comm: Comm,
    replicated: dict[str, tuple[str, ...]],
    spec: ModelSpec,
    tied: tuple[str, Group] | None,
) -> tuple[list[GradSync], dict[str, tuple[str, ...]]]:
    """Each group's gradient sync, built in the groups' order (dense first, with the
    embedding tied across the pipeline's ends): ZeRO's shards over its axis (fsdp:
    replicas all-reduced over dp, HSDP), or, held whole, the bucketed all-reduce over its
    data group. And `replicated` with the shard views' axes (the norm counts each once)."""
    syncs: list[GradSync] = []
    for group in groups:
        if group.sharded:
            # the groups after it (those before it are sharded: no longer in the model)
            rest = [n for n, _ in model.named_parameters() if n not in group.names]
            own_tied = tied if group.name == "dense" else None
            shards = ZeroShards(
                model, mesh, comm, layout, replicated, spec, own_tied, rest, group.axis
            )
            replicated = {**replicated, **shards.view_replicated()}
            syncs.append(shards)
        else:  # every parameter of the group still in the model (ZeRO took the others)
            named = group.of(model.named_parameters())
            syncs.append(_replicated_grads(named, layout, mesh[group.data], comm))
    return syncs, replicated


def _replicated_grads(named, layout: Layout, data: Group, comm: Comm) -> LocalGrads:
    """Without ZeRO: DP's bucketed all-reduce over `data`, or nothing to reduce."""
    dtype = layout.compute_dtype
    if data.size == 1:
        return LocalGrads(named, dtype)
    first = layout.first_bucket_bytes or first_bucket_bytes(comm.device, layout.bucket_bytes)
    return GradBuckets(
        named,
        data,
        comm,
        layout.bucket_bytes,
        dtype,
        layout.reduce_dtype,
        first,
        *layout.compression,
    )
