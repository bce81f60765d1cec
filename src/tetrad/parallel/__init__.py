"""`parallelize`: build the model for this rank's place in the mesh, in one fixed order."""

from __future__ import annotations

import torch

from tetrad.comm import Comm
from tetrad.config import Config
from tetrad.mesh import Mesh
from tetrad.models.init import materialize
from tetrad.models.llama import Llama
from tetrad.parallel.engine import Engine


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
    if mesh.degrees["pp"] > 1:
        raise NotImplementedError("pipeline parallelism lands with the pipeline issue")
    slicer = None
    if mesh.degrees["tp"] > 1:
        raise NotImplementedError("tensor parallelism lands with the tensor-parallel issue")
    materialize(model, cfg.model, cfg.train.seed, device, slicer)
    engine = Engine(model, mesh, comm, cfg)
    if mesh.degrees["fsdp"] > 1:
        raise NotImplementedError("sharded data parallelism lands with the ZeRO issue")
    engine.start_grad_sync()
    return engine
