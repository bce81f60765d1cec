"""The MoE layers' step bookkeeping: the auxiliary loss's scale, the loss-free bias update,
and the expert-load metrics (docs/moe.md).

Each MoE layer (the family's spec names them, `ModelSpec.moe`) adds its routing
statistics to its `stats` during forward; here they
are reset before each step, laid out for the step's one all-reduce over the world (the
trainer's: loss, norm and flags ride on it too, so MoE adds no collective and no host
sync to a step) and turned into the bias update (after the optimizer step, on the device)
and the metrics row (from the values that one host sync read).
"""

from __future__ import annotations

import math

import torch

from tetrad.config import Config
from tetrad.mesh import Mesh
from tetrad.models.families import spec_for


class ExpertBalance:
    """The trainer's side of the MoE layers of this rank's model (inert without any)."""

    def __init__(self, engine, cfg: Config, mesh: Mesh):
        self.model_cfg, self.mesh = cfg.model, mesh
        self.tokens_split_over_tp = cfg.parallel.sp  # each tp rank routes its own tokens
        self.device = engine.device
        # this rank's MoE layers (a pipeline stage holds some), by block index, and the
        # statistics after the loads: none in a family without experts
        self.layers, self.extra = {}, 0
        if (moe := spec_for(cfg.model).moe) is not None:
            self.layers, self.extra = moe.layers(engine.model), moe.stat_extra
            # the auxiliary loss is a mean over the global batch's sequences, like the token
            # loss is over its tokens: every layout injects the same gradient per sequence
            moe.set_aux_scale(engine.model, cfg.train.global_batch)
        self.sequences = cfg.train.global_batch
        self.summed: torch.Tensor | None = None  # the last step's statistics (`take`)
        self.rows: list[list[float]] = []
        if self.layers and cfg.model.balance == "bias":
            engine.on_step(self.update_bias)

    def begin_step(self) -> None:
        """Forget what earlier forwards (an evaluation's included) recorded."""
        for ffn in self.layers.values():
            ffn.reset_stats()

    def local(self) -> torch.Tensor:
        """This rank's statistics, flat [MoE layers of the whole model x (experts +
        `MoEParts.stat_extra`)] float64 on the device (empty without MoE), for the
        trainer to ride on the step's one all-reduce over the world: summed there, each
        layer's row is the whole global batch's (a stage fills the rows of its layers; tp
        ranks route the same tokens, so only tp rank 0 counts them, unless sp gives each
        its own)."""
        m = self.model_cfg
        if not m.moe:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        out = torch.zeros(m.layers, m.experts + self.extra, dtype=torch.float64, device=self.device)
        if self.mesh.coord["tp"] == 0 or self.tokens_split_over_tp:
            for i, ffn in self.layers.items():
                if ffn.stats is not None:
                    out[i] = ffn.stats  # a device copy: no host sync per layer
        return out[m.dense_layers :].reshape(-1)

    def take(self, summed: torch.Tensor, values: list[float]) -> None:
        """The step's statistics summed over the world: on the device (`summed`, for the
        bias update) and on the host (`values`, read by the step's one host sync, for the
        metrics), as `local` laid them out."""
        if not self.model_cfg.moe:
            return
        width = self.model_cfg.experts + self.extra
        self.summed = summed.view(-1, width)
        self.rows = [values[i : i + width] for i in range(0, len(values), width)]

    @torch.no_grad()
    def update_bias(self) -> None:
        """expert_bias += rate · sign(mean load - load), the load over the global batch
        (`take`'s, already summed: no collective and no host sync here; each stage updates
        the layers it holds)."""
        for i, ffn in self.layers.items():
            row = self.summed[i - self.model_cfg.dense_layers]
            ffn.router.update_bias(row[: self.model_cfg.experts], self.model_cfg.bias_rate)

    def metrics(self) -> dict:
        """Per MoE layer: max and mean tokens per expert, the auxiliary loss (coef applied,
        mean over the sequences) and the mean router entropy; and their sum of aux losses.
        From the last step's statistics (`take`): no collective."""
        if not self.model_cfg.moe:
            return {}
        n, coef = self.model_cfg.experts, self.model_cfg.aux_loss_coef
        rows, total = {}, 0.0
        for i, row in enumerate(self.rows):
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
