"""The MoE layers' step bookkeeping: the auxiliary loss's scale, the loss-free bias update,
and the expert-load metrics (docs/moe.md).

Each `MoEFeedForward` adds its routing statistics to its `stats` during forward; here they
are reset before each step, summed over the ranks that saw different tokens and turned
into the bias update (after the optimizer step) and the metrics row.
"""

from __future__ import annotations

import math

import torch

from tetrad.comm import Comm
from tetrad.config import Config
from tetrad.mesh import Mesh
from tetrad.models.moe import STAT_EXTRA, moe_layers, set_aux_scale


class ExpertBalance:
    """The trainer's side of the MoE layers of this rank's model (inert without any)."""

    def __init__(self, engine, cfg: Config, mesh: Mesh, comm: Comm):
        self.model_cfg, self.mesh, self.comm = cfg.model, mesh, comm
        self.layers = moe_layers(engine.model)  # this rank's (a pipeline stage holds some)
        self.device = engine.device
        # the auxiliary loss is a mean over the global batch's sequences, like the token
        # loss is over its tokens: every layout injects the same gradient per sequence
        set_aux_scale(engine.model, cfg.train.global_batch)
        self.sequences = cfg.train.global_batch
        if self.layers and cfg.model.balance == "bias":
            engine.on_step(self.update_bias)

    def begin_step(self) -> None:
        """Forget what earlier forwards (an evaluation's included) recorded."""
        for ffn in self.layers.values():
            ffn.reset_stats()

    def _local(self) -> torch.Tensor:
        """[MoE layers of the whole model, experts + STAT_EXTRA]: this rank's rows filled."""
        m = self.model_cfg
        out = torch.zeros(m.layers, m.experts + STAT_EXTRA, dtype=torch.float64, device=self.device)
        for i, ffn in self.layers.items():
            if ffn.stats is not None:
                out[i] = ffn.stats  # a device copy: no host sync per layer
        return out[m.dense_layers :]

    @torch.no_grad()
    def update_bias(self) -> None:
        """expert_bias += rate · sign(mean load - load), the load over the global batch
        (summed over the data ranks; each stage updates the layers it holds)."""
        loads = self._local()
        self.comm.all_reduce(loads, self.mesh["data"])
        for i, ffn in self.layers.items():
            row = loads[i - self.model_cfg.dense_layers]
            ffn.router.update_bias(row[: self.model_cfg.experts], self.model_cfg.bias_rate)

    def metrics(self) -> dict:
        """Per MoE layer: max and mean tokens per expert, the auxiliary loss (coef applied,
        mean over the sequences) and the mean router entropy; and their sum of aux losses.
        A collective: every rank calls it."""
        if not self.model_cfg.moe:
            return {}
        stats = self._local()
        if self.mesh.coord["tp"] != 0:
            stats.zero_()  # tp ranks route the same tokens: counted once
        self.comm.all_reduce(stats, self.mesh["world"])
        n, coef = self.model_cfg.experts, self.model_cfg.aux_loss_coef
        rows, total = {}, 0.0
        for i, row in enumerate(stats.tolist()):
            load, (aux, entropy, tokens) = row[:n], row[n:]
            aux = coef * aux / self.sequences
            total += aux
            rows[str(i + self.model_cfg.dense_layers)] = {
                "load_max": max(load),
                "load_mean": sum(load) / n,
                "aux_loss": aux,
                "router_entropy": entropy / tokens if tokens else math.nan,
            }
        return {"moe_aux_loss": total, "moe_layers": rows}
