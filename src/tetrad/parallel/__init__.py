"""`parallelize`: build the model for this rank's place in the mesh, in one fixed order."""

from __future__ import annotations

import torch

from tetrad.comm import Comm
from tetrad.config import Config
from tetrad.mesh import Mesh
from tetrad.models.init import materialize
from tetrad.models.llama import Llama
from tetrad.models.plans import LLAMA_PLAN
from tetrad.parallel.engine import Engine
from tetrad.parallel.pipeline.runtime import attach_pipeline
from tetrad.parallel.pipeline.stage import prune, rank_chunks
from tetrad.parallel.tensor import apply_tp
from tetrad.parallel.zero import ZeroEngine


def parallelize(cfg: Config, mesh: Mesh, comm: Comm, device: torch.device) -> Engine:
    """Build, shard and materialise the model; return the engine that runs its steps.

    The order is fixed, each step working on what the one before left:
      1. build the whole model on the meta device (no memory);
      2. pipeline split: keep only this stage's layers (pp);
      3. tensor parallelism: shrink each planned linear/embedding to its tp slice;
      4. materialise: fill each local tensor with its slice of the layout-invariant init;
      5. data parallelism last, over the final local parameters: ZeRO shards (fsdp) or
         bucketed all-reduce (dp).
    """
    with torch.device("meta"):
        model = Llama(cfg.model)
    chunks = None
    if mesh.degrees["pp"] > 1:
        chunks = rank_chunks(cfg, mesh["pp"].rank)
        prune(model, chunks)
    layout = None
    if mesh.degrees["tp"] > 1:
        layout = apply_tp(model, LLAMA_PLAN, mesh, comm, cfg)
    materialize(model, cfg.model, cfg.train.seed, device, layout.slicer if layout else None)
    engine = Engine(model, mesh, comm, cfg)
    if layout is not None:
        engine.replicated.update(layout.replicated)  # tp shards: replicated over dp/fsdp only
        engine.loss_fn, engine.unshard = layout.loss_fn, layout.unshard
        engine.slicer = layout.slicer  # checkpoints install each rank's slice with it
    if chunks is not None:
        attach_pipeline(engine, cfg, chunks)  # before data parallelism wraps the parameters
    if mesh.degrees["fsdp"] > 1:
        return ZeroEngine(engine)  # shards over fsdp, replicas all-reduced over dp (HSDP)
    engine.start_grad_sync()
    return engine
