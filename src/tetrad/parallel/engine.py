"""The engine: a model laid out on the mesh, and the step mechanics that layout needs.

The trainer only ever talks to an `Engine`: run forward and backward over this rank's
microbatches, finish the gradient synchronisation, report this rank's share of the global
gradient norm, and hand the optimizer its parameters. Layouts that change the step's
mechanics (ZeRO shards, pipeline schedules) subclass it; layouts that only change the
model's modules (tensor parallelism) do not need to.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tetrad.comm import Comm
from tetrad.config import Config
from tetrad.mesh import Mesh
from tetrad.models.batch import Microbatch
from tetrad.models.init import Slicer
from tetrad.models.llama import cross_entropy_sum
from tetrad.parallel.data import GradBuckets
from tetrad.parallel.pipeline.runtime import PipelineRuntime, gather_stages

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Axes a parameter is, by default, replicated over (identical on every rank of them).
REPLICATED = ("dp", "fsdp", "tp")
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state, as torch names it


class Engine:
    """Plain data-parallel execution of a (possibly TP-sharded) model."""

    def __init__(self, model: nn.Module, mesh: Mesh, comm: Comm, cfg: Config):
        self.model, self.mesh, self.comm, self.cfg = model, mesh, comm, cfg
        self.loss_fn: LossFn = cross_entropy_sum
        # name -> axes over which that parameter is replicated; a layout that shards a
        # parameter along an axis removes the axis (tensor parallelism: "tp").
        self.replicated: dict[str, tuple[str, ...]] = {
            n: REPLICATED for n, _ in model.named_parameters()
        }
        self.grad_sync: GradBuckets | None = None
        # set by a layout that splits parameters (tensor parallelism): rebuilds the full
        # tensor from every rank's shard; a collective, so every rank calls it
        self.unshard: Callable[[str, torch.Tensor], torch.Tensor] | None = None
        # its inverse: the index of this rank's shard in a full tensor (None: all of it)
        self.slicer: Slicer | None = None
        # set by pipeline parallelism: runs the schedule instead of a plain microbatch loop
        self.pipeline: PipelineRuntime | None = None
        self.tied_across_stages = False  # tied embedding held by the first and last stages

    def start_grad_sync(self) -> None:
        """Bucket gradients over the data group (call once the model is final)."""
        data = self.mesh["data"]
        if data.size > 1:
            bucket_bytes = int(self.cfg.parallel.bucket_mb * 2**20)
            params = [p for _, p in self.named_parameters()]
            self.grad_sync = GradBuckets(params, data, self.comm, bucket_bytes)

    # --- what the trainer calls -------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters the optimizer updates, with their logical names."""
        return list(self.model.named_parameters())

    @property
    def loss_owner(self) -> bool:
        """Whether this rank's loss contribution is counted (once per data rank)."""
        holds_head = self.pipeline.holds_last if self.pipeline else self.mesh.pp_next is None
        return self.mesh.coord["tp"] == 0 and holds_head

    def forward_backward(self, micro: list[Microbatch], denom: float) -> torch.Tensor:
        """Accumulate gradients of sum(token losses)/denom; return this rank's loss share."""
        if self.pipeline is not None:
            if self.grad_sync is not None:
                self.grad_sync.sync = False  # buckets are all launched after the schedule
            self.pipeline_state = self.pipeline.run(micro, denom)
            return self.pipeline_state.loss.float()
        total = torch.zeros((), dtype=torch.float32)
        for i, mb in enumerate(micro):
            if self.grad_sync is not None:
                # no_sync: only the last microbatch's backward launches the reductions
                self.grad_sync.sync = i == len(micro) - 1
            logits = self.model(mb.inputs.to(self.device))
            loss = self.loss_fn(logits, mb.targets.to(self.device)) / denom
            del logits  # the graph keeps what backward needs; the logits may go (b·s·V)
            loss.backward()
            total += loss.detach().float().cpu()
        return total

    def sync_grads(self) -> None:
        """Wait for every gradient reduction of the step."""
        if self.grad_sync is not None:
            self.grad_sync.finish()
        if self.tied_across_stages:
            # first and last stage each hold the tied embedding: sum their gradients
            grad = self.model.tok_embeddings.weight.grad
            self.comm.all_reduce(grad, self.mesh["pp_ends"])

    def grad_sq_norm(self) -> torch.Tensor:
        """Sum of squared gradient entries this rank owns; summed over the world = norm²."""
        coord = self.mesh.coord
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            if all(coord[a] == 0 for a in self.replicated[name]):
                total += p.grad.detach().double().pow(2).sum()
        return total.cpu()

    def scale_grads(self, factor: float) -> None:
        for _, p in self.named_parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def zero_grad(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.zero_grad()
            return
        for _, p in self.named_parameters():
            if p.grad is not None:
                p.grad.zero_()

    def after_step(self) -> None:
        """Hook for layouts that must act after the optimizer (ZeRO re-gathers weights)."""

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (tp shards, its stages) by logical name; ZeRO overrides it."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every logical parameter, full size, on CPU (for tests and checkpoint export)."""
        return self.gather_full(self.local_state_dict())

    def gather_full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full fp32 CPU tensors from per-parameter local ones (a collective): tp shards
        joined, and every stage's names on every rank."""
        unshard = self.unshard or (lambda _, t: t)
        state = {n: unshard(n, t).float().cpu().clone() for n, t in local.items()}
        if self.pipeline is not None:
            state = gather_stages(state, self.cfg, self.mesh, self.comm, self.device)
        return state

    # --- checkpoints: full logical tensors out, this rank's slices in ------------------
    def local_names(self) -> list[str]:
        """Logical names of the parameters this rank holds (its stages; tp shards too)."""
        return [n for n, _ in self.model.named_parameters()]

    def local_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full logical tensor `name` (its tp shard, or all)."""
        index = self.slicer(name) if self.slicer else None
        return full if index is None else full[index]

    def local_optimizer_state(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        """AdamW moments by kind and local logical name (zeros before the first step, which
        AdamW treats alike), and the step count; ZeRO overrides it."""
        moments: dict[str, dict[str, torch.Tensor]] = {k: {} for k in MOMENTS}
        step = 0
        for name, p in self.named_parameters():
            state = optimizer.state.get(p, {})
            for k in MOMENTS:
                moments[k][name] = state[k] if k in state else torch.zeros_like(p)
            step = max(step, int(state.get("step", 0)))
        return moments, step

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """Full logical AdamW state on every rank (a collective, like full_state_dict):
        "exp_avg/<name>", "exp_avg_sq/<name>", and "step", the count every tensor shares
        (the trainer steps all of them together)."""
        moments, step = self.local_optimizer_state(optimizer)
        out = {}
        for kind, local in moments.items():
            out.update({f"{kind}/{n}": t for n, t in self.gather_full(local).items()})
        out["step"] = torch.tensor(float(step))
        return out

    @torch.no_grad()
    def load_full(
        self,
        params: dict[str, torch.Tensor],
        optim: dict[str, torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """Install this rank's slices of full logical tensors (no collective): parameters
        and, given `optim` (as full_optimizer_state returns it), the AdamW state."""
        names = self.local_names()
        local = {n: self.local_slice(n, params[n]) for n in names}
        moments, step = None, 0
        if optim is not None:
            moments = {
                k: {n: self.local_slice(n, optim[f"{k}/{n}"]) for n in names} for k in MOMENTS
            }
            step = int(optim["step"])
        self.load_local(local, moments, step, optimizer)

    def load_local(
        self,
        params: dict[str, torch.Tensor],
        moments: dict[str, dict[str, torch.Tensor]] | None,
        step: int,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        """Copy local logical tensors into the parameters and their AdamW state."""
        for name, p in self.named_parameters():
            p.copy_(params[name])
            if moments is not None:
                set_adam_state(optimizer, p, step, *(moments[k][name] for k in MOMENTS))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def set_adam_state(
    optimizer: torch.optim.Optimizer,
    p: torch.Tensor,
    step: int,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
) -> None:
    """Give `p` the AdamW state torch would hold after `step` steps (none before the first)."""
    if step == 0:
        optimizer.state.pop(p, None)  # AdamW starts zeroed moments itself
        return
    optimizer.state[p] = {
        "step": torch.tensor(float(step), dtype=torch.float32),
        "exp_avg": exp_avg.to(p.device, p.dtype).clone(),
        "exp_avg_sq": exp_avg_sq.to(p.device, p.dtype).clone(),
    }
