"""State adapters: a layout's parameters as full logical tensors, and back; its parameters
and AdamW state as boxes of them (sharded checkpoints).

Tests, export and Hugging Face weights speak full logical tensors (by parameter name, whole, in
the masters' dtype: float32, or float64 under fp64; on CPU); each layout holds something
else (tp shards, some stages, ZeRO flat shards). A state adapter owns that translation
for one engine. Out is a collective (tp shards all-gathered, every stage broadcast over
pp); in needs none: every rank loads from the full tensors and keeps its slices.

`PlainAdapter` serves every layout whose optimizer tensors are the model's parameters (DP,
TP, PP); `ZeroAdapter` (zero_adapter.py) overrides both halves for ZeRO's flat shards.

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
        # tp: the index of this rank's shard in a full tensor (None: the whole tensor)
        self.slicer = slicer or (lambda _: None)
        # name -> the tensor the optimizer steps: the parameter, or its fp32 master
        self.optimized = dict(optimized or model.named_parameters())

    # --- the local half: what a layout holds, by logical name -----------------------------
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (tp shards, its stages) by logical name: the fp32 masters
        in mixed precision."""
        return {n: self.optimized[n].detach() for n, _ in self.model.named_parameters()}

    def _set(self, name: str, p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """`value`, this rank's piece of `name`, into the parameter `p` and its fp32
        master; returns the tensor the optimizer steps (the master, or `p`)."""
        master = self.optimized[name]
        master.copy_(value.reshape(master.shape))
        if master is not p:
            p.copy_(master)
        return master

    # --- the sharded half: owned boxes out, needed boxes in ---------------------------------
    def box(self, name: str) -> Box:
        """Where this rank's local tensor `name` sits in the full logical tensor."""
        return index_box(self.slicer(name), tuple(full_shape(name, self.model_cfg)))

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
        out: Owned = []
        for name, _ in self.model.named_parameters():
            if self.writes(name, replicated):
                p, box = self.optimized[name], self.box(name)  # the parameter, or its master
                out.append((name, box, snapshot(p)))
                out += [(f"{k}/{name}", box, snapshot(moment(optimizer, p, k))) for k in MOMENTS]
        return out, adam_step(optimizer)

    def owned_buffers(self) -> Owned:
        """The model's buffers (running state the optimizer does not step, such as an MoE
        router's balancing bias) as "buffer/<name>" boxes, whole: written by the rank at
        coordinate 0 of every axis but pp (each stage's own), the same on all of them."""
        if any(at for axis, at in self.mesh.coord.items() if axis != "pp"):
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
            master = self._set(name, p, read(name, box))
            moments = (read(f"{k}/{name}", box).view(box_shape(box)) for k in MOMENTS)
            set_adam_state(optimizer, master, step, *moments)

    def after_load(self) -> None:
        """The collective part of a load, once every rank has loaded (ZeRO: gathers)."""

    # --- the full half: the same for every layout ----------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every logical parameter, full size, wide (fp32; fp64 under fp64), on CPU (a
        collective): tp shards joined, and every stage's names on every rank."""
        local = self.local_state_dict()
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
                t = t.to(self.comm.device)  # NCCL broadcasts device tensors only
                self.comm.broadcast(t, r, pp)
                out[name] = t.cpu()
        return out

    @torch.no_grad()
    def load_full(self, params: dict[str, torch.Tensor]) -> None:
        """Install this rank's slices of full logical parameters (no collective)."""
        for name, p in self.model.named_parameters():
            self._set(name, p, self._slice(name, params[name]))

    def _slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full logical tensor `name` (its tp shard, or all)."""
        index = self.slicer(name)
        # indexed even when whole: `full` may be lazy (read on indexing, see interop.hf)
        return full[...] if index is None else full[index]


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A wide (float32; float64 under fp64) CPU copy of `t` that later updates of `t`
    cannot change."""
    t = t.detach()
    return t.to("cpu", wide(t.dtype), copy=True).contiguous()


def moment(optimizer: torch.optim.Optimizer, p: torch.Tensor, kind: str) -> torch.Tensor:
    """AdamW's `kind` moment of `p` (zeros before the first step, which AdamW treats alike)."""
    state = optimizer.state.get(p, {})
    return state[kind] if kind in state else torch.zeros_like(p)


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
