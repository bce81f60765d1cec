"""`parallelize`: build the model for this rank's place in the mesh, and its engine."""

from __future__ import annotations

import torch

from tetrad.comm import Comm
from tetrad.config import DTYPES, Config
from tetrad.mesh import Mesh
from tetrad.models.families import spec_for
from tetrad.models.init import materialize
from tetrad.models.loss import ChunkedCrossEntropy, cross_entropy_sum
from tetrad.parallel.data import GradBuckets, LocalGrads, TiedGrads
from tetrad.parallel.engine import Engine
from tetrad.parallel.local import local_model
from tetrad.parallel.pipeline.runtime import build_pipeline, tied_across_stages
from tetrad.parallel.runner import GradSync, LossFn, MicrobatchLoop, Runner
from tetrad.parallel.state import PlainState
from tetrad.parallel.tensor import TPLayout
from tetrad.parallel.zero import ZeroShards
from tetrad.parallel.zero_state import ZeroState


def parallelize(cfg: Config, mesh: Mesh, comm: Comm, device: torch.device) -> Engine:
    """Build, shard and materialise the model; return the engine that runs its steps.

    The order is fixed, each step working on what the one before left:
      1. build the whole model on the meta device (no memory);
      2. pipeline split: keep only this stage's layers (pp);
      3. tensor parallelism: shrink each planned linear/embedding to its tp slice;
      4. materialise: fill each local tensor with its slice of the layout-invariant init;
      5. the model's memory settings (recomputation; a chunked loss that applies the
         head itself), then the runner: the pipeline schedule (its split backward rewires
         linears), or the plain microbatch loop;
      6. data parallelism last, over the final local parameters: ZeRO shards (fsdp) or
         bucketed all-reduce (dp), and the matching state adapter. Either one owns the
         mixed precision: compute parameters in `train.dtype` (cast here, from the fp32
         values just materialised, which become the fp32 master weights).
    """
    spec = spec_for(cfg.model)
    local = local_model(cfg, mesh, comm)  # 1-3
    model, tp = local.model, local.tp
    materialize(model, cfg.model, cfg.train.seed, device, tp.slicer if tp else None)
    spec.set_recompute(model, cfg.train.recompute)
    loss_fn = _loss_fn(model, cfg, tp)
    replicated = local.replicated
    runner: Runner = MicrobatchLoop(model, loss_fn, meter_every=cfg.train.meter_every)
    if local.chunks is not None:
        runner = build_pipeline(model, cfg, mesh, comm, local.chunks, loss_fn)
        embed = spec.tied_weight
        if cfg.model.tie_embeddings and embed in replicated:  # held by both ends
            replicated[embed] = (*replicated[embed], "pp")  # counted once: on pp rank 0
    unshard, slicer = (tp.unshard, tp.slicer) if tp else (None, None)
    grads: GradSync
    # first and last stage each hold the tied embedding: their gradients are summed
    tied = (spec.tied_weight, mesh["pp_ends"]) if tied_across_stages(cfg, mesh) else None
    if mesh.degrees["fsdp"] > 1:  # shards over fsdp, replicas all-reduced over dp (HSDP)
        shards = ZeroShards(model, mesh, comm, cfg, replicated, tied)  # tied: full grads
        grads, replicated = shards, {**replicated, **shards.view_replicated()}
        state = ZeroState(shards, model, cfg, mesh, comm, unshard, slicer)
        runner.meter.exclude(u.flat for u in shards.units)  # parameters, not activations
    else:
        grads = _replicated_grads(model, cfg, mesh, comm)
        state = PlainState(model, cfg, mesh, comm, unshard, slicer, grads.params())
        if tied is not None:
            grads = TiedGrads(grads, *tied, comm)
    return Engine(model, mesh, comm, runner, grads, state, replicated)


def _replicated_grads(model: torch.nn.Module, cfg: Config, mesh: Mesh, comm: Comm) -> LocalGrads:
    """Without ZeRO: DP's bucketed all-reduce over the data ranks, or nothing to reduce."""
    named = list(model.named_parameters())
    dtype = DTYPES[cfg.train.dtype]
    data = mesh["data"]
    if data.size == 1:
        return LocalGrads(named, dtype)
    bucket_bytes = int(cfg.parallel.bucket_mb * 2**20)
    reduce_dtype = DTYPES[cfg.parallel.reduce_dtype]
    return GradBuckets(named, data, comm, bucket_bytes, dtype, reduce_dtype)


def _loss_fn(model: torch.nn.Module, cfg: Config, tp: TPLayout | None) -> LossFn:
    """Cross-entropy over the head's logits, or (`loss_chunk` > 0) the head and the loss
    fused in chunks of tokens, the model stopping at the final norm; vocabulary-parallel
    under tp either way."""
    chunk = cfg.train.loss_chunk
    if chunk == 0:
        return tp.loss_fn if tp else cross_entropy_sum
    model.logits = False
    return tp.chunked_loss_fn(model, chunk) if tp else ChunkedCrossEntropy(model, chunk)
