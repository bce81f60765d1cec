"""State adapters: a layout's parameters and AdamW state as full logical tensors, and back.

Checkpoints, tests and export speak full logical tensors (by parameter name, whole, in
the masters' dtype: float32, or float64 under fp64; on CPU); each layout holds something
else (tp shards, some stages, ZeRO flat shards). A state adapter owns that translation
for one engine. Out is a collective (tp shards all-gathered, every stage broadcast over
pp); in needs none: every rank loads from the full tensors and keeps its slices.

`PlainAdapter` serves every layout whose optimizer tensors are the model's parameters (DP,
TP, PP); `ZeroAdapter` (zero_adapter.py) overrides the local half for ZeRO's flat shards.

Sharded checkpoints use a third half, with no full tensor anywhere: `owned_slices` lists
the boxes of the full logical tensors this rank holds and is the one writer of (a replica
on dp, on tp for an unsplit tensor, on pp for a tied embedding writes nothing), and
`load_owned` fills this rank's boxes from a reader of any saved layout's boxes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tetrad.comm import Comm
from tetrad.config import ModelConfig
from tetrad.layout import Layout
from tetrad.mesh import Mesh
from tetrad.models.init import Slicer, full_shape
from tetrad.parallel.boxes import Box, box_shape, index_box
from tetrad.parallel.local import stage_param_names
from tetrad.precision import wide, widen

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state, as torch names it
Unshard = Callable[[str, torch.Tensor], torch.Tensor]
Moments = dict[str, dict[str, torch.Tensor]]  # kind -> name -> tensor
Owned = list[tuple[str, Box, torch.Tensor]]  # (logical key, its box in the full tensor, data)
Reader = Callable[[str, Box], torch.Tensor]  # (logical key, box) -> that box's values
BUFFER = "buffer/"  # the key prefix of a model buffer's saved value


class PlainAdapter:
    """Full logical tensors from and into a model whose parameters the optimizer updates."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        model_cfg: ModelConfig,
        mesh: Mesh,
        comm: Comm,
        unshard: Unshard | None = None,
        slicer: Slicer | None = None,
        optimized: list[tuple[str, torch.Tensor]] | None = None,
    ):
        self.model, self.mesh, self.comm = model, mesh, comm
        self.layout, self.model_cfg = layout, model_cfg
        self.unshard = unshard or (lambda _, t: t)  # tp: all-gathers a shard (a collective)
        self.slicer = slicer  # tp: the index of this rank's shard in a full tensor
        # name -> the tensor the optimizer steps: the parameter, or its fp32 master
        self.optimized = dict(optimized or model.named_parameters())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- the local half: what a layout holds, by logical name -----------------------------
    def local_names(self) -> list[str]:
        """Logical names of the parameters this rank holds (its stages; tp shards too)."""
        return [n for n, _ in self.model.named_parameters()]

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (tp shards, its stages) by logical name: the fp32 masters
        in mixed precision."""
        return {n: self.optimized[n].detach() for n, _ in self.model.named_parameters()}

    def local_optimizer_state(self, optimizer: torch.optim.Optimizer) -> tuple[Moments, int]:
        """AdamW moments by kind and local name (zeros before the first step, which AdamW
        treats alike), and the step count."""
        moments: Moments = {k: {} for k in MOMENTS}
        for name, _ in self.model.named_parameters():
            p = self.optimized[name]
            state = optimizer.state.get(p, {})
            for k in MOMENTS:
                moments[k][name] = state[k] if k in state else torch.zeros_like(p)
        return moments, adam_step(optimizer)

    @torch.no_grad()
    def load_local(
        self,
        params: dict[str, torch.Tensor],
        moments: Moments | None,
        step: int,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        """Copy local logical tensors into the parameters (and their masters) and the
        AdamW state."""
        for name, p in self.model.named_parameters():
            master = self.optimized[name]
            master.copy_(params[name])
            if master is not p:
                p.copy_(master)
            if moments is not None:
                set_adam_state(optimizer, master, step, *(moments[k][name] for k in MOMENTS))

    # --- the sharded half: owned boxes out, needed boxes in ---------------------------------
    def box(self, name: str) -> Box:
        """Where this rank's local tensor `name` sits in the full logical tensor."""
        shape = tuple(full_shape(name, self.model_cfg))
        return index_box(self.slicer(name) if self.slicer else None, shape)

    def writes(self, name: str, replicated: dict[str, tuple[str, ...]], axis: str = "fsdp") -> bool:
        """Whether this rank is the one writer of its copy of `name`: coordinate 0 on every
        axis the value is replicated over (the same rule that counts it once in the norm)
        but fsdp and `axis`, which ZeRO's shards split (ep_data for expert weights): every
        rank of those writes its own piece."""
        coord = self.mesh.place
        return all(coord[a] == 0 for a in replicated[name] if a not in ("fsdp", axis))

    def owned_slices(
        self, optimizer: torch.optim.Optimizer, replicated: dict[str, tuple[str, ...]]
    ) -> tuple[Owned, int]:
        """The boxes this rank writes: "<name>", "exp_avg/<name>", "exp_avg_sq/<name>" (fp32
        copies, safe from the next step), and the AdamW step count."""
        moments, step = self.local_optimizer_state(optimizer)
        out: Owned = []
        for name, _ in self.model.named_parameters():
            if self.writes(name, replicated):
                box = self.box(name)
                out.append((name, box, snapshot(self.optimized[name])))  # fp32 master
                out += [(f"{k}/{name}", box, snapshot(moments[k][name])) for k in MOMENTS]
        return out, step

    def owned_buffers(self) -> Owned:
        """The model's buffers (running state the optimizer does not step, such as an MoE
        router's balancing bias) as "buffer/<name>" boxes, whole: written by the rank at
        coordinate 0 of every axis but pp (each stage's own), the same on all of them."""
        coord = self.mesh.coord
        if any(coord[a] for a in coord if a != "pp"):
            return []
        return [
            (f"{BUFFER}{name}", index_box(None, tuple(b.shape)), snapshot(b))
            for name, b in self.model.named_buffers()
        ]

    @torch.no_grad()
    def load_buffers(self, read: Reader) -> None:
        """Fill every buffer of this rank's model from its saved "buffer/<name>" box."""
        for name, b in self.model.named_buffers():
            b.copy_(read(f"{BUFFER}{name}", index_box(None, tuple(b.shape))).view(b.shape))

    @torch.no_grad()
    def load_owned(self, read: Reader, step: int, optimizer: torch.optim.Optimizer) -> None:
        """Fill this rank's parameters and AdamW state from `read` (no collective)."""
        for name, p in self.model.named_parameters():
            box = self.box(name)
            master = self.optimized[name]  # the parameter, or its fp32 master
            master.copy_(read(name, box).view(master.shape))
            if master is not p:
                p.copy_(master)
            moments = (read(f"{k}/{name}", box).view(box_shape(box)) for k in MOMENTS)
            set_adam_state(optimizer, master, step, *moments)

    def after_load(self) -> None:
        """The collective part of a load, once every rank has loaded (ZeRO: gathers)."""

    # --- the full half: the same for every layout ----------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every logical parameter, full size, on CPU (a collective)."""
        return self.gather_full(self.local_state_dict())

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """Full logical AdamW state on every rank (a collective): "exp_avg/<name>",
        "exp_avg_sq/<name>", and "step", the count every tensor shares (the trainer steps
        all of them together)."""
        moments, step = self.local_optimizer_state(optimizer)
        out = {}
        for kind, local in moments.items():
            out.update({f"{kind}/{n}": t for n, t in self.gather_full(local).items()})
        out["step"] = torch.tensor(float(step))
        return out

    def gather_full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full wide (fp32; fp64 under fp64) CPU tensors from per-parameter local ones (a
        collective): tp shards joined, and every stage's names on every rank."""
        state = {n: widen(self.unshard(n, t)).cpu().clone() for n, t in local.items()}
        if self.mesh.degrees["pp"] > 1:
            state = self._gather_stages(state)
        return state

    def _gather_stages(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's full tensors on every rank: each broadcast from its holder over pp."""
        out: dict[str, torch.Tensor] = {}
        pp = self.mesh["pp"]
        for r in range(pp.size):
            for name in stage_param_names(self.layout, self.model_cfg, r):
                if name in out:
                    continue  # a tied embedding held by two stages: the first one's value
                shape, dtype = full_shape(name, self.model_cfg), self.layout.master_dtype
                t = state[name] if r == pp.rank else torch.empty(shape, dtype=dtype)
                t = t.to(self.device)  # NCCL broadcasts device tensors only
                self.comm.broadcast(t, r, pp)
                out[name] = t.cpu()
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
        local = {n: self._slice(n, params[n]) for n in names}
        moments, step = None, 0
        if optim is not None:
            moments = {k: {n: self._slice(n, optim[f"{k}/{n}"]) for n in names} for k in MOMENTS}
            step = int(optim["step"])
        self.load_local(local, moments, step, optimizer)

    def _slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full logical tensor `name` (its tp shard, or all)."""
        index = self.slicer(name) if self.slicer else None
        # indexed even when whole: `full` may be lazy (read on indexing, see interop.hf)
        return full[...] if index is None else full[index]


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A wide (float32; float64 under fp64) CPU copy of `t` that later updates of `t`
    cannot change."""
    t = t.detach()
    return t.to("cpu", wide(t.dtype), copy=True).contiguous()


def adam_step(optimizer: torch.optim.Optimizer) -> int:
    """The AdamW step count, which every tensor shares (the trainer steps all together)."""
    return max((int(state.get("step", 0)) for state in optimizer.state.values()), default=0)


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
