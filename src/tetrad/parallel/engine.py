"""The engine: a model laid out on the mesh, assembled from the parts its layout names.

The trainer only ever talks to an `Engine`. One step's path through it:

    loader -> runner.run (forward and backward of this rank's microbatches)
           -> grads.finish (the gradient reductions of the step: DP buckets, ZeRO shards)
           -> grad_sq_norm -> the optimizer (on grads.params()) -> grads.after_step
    checkpoints <-> state (full logical tensors out, this rank's slices in)

`parallelize` picks the parts: the *runner* (the plain microbatch loop, or the pipeline
runtime), the *gradient sync* (none, DP buckets, ZeRO shards; optionally wrapped to sum a
tied embedding across stages) and the *state adapter* (plain, or ZeRO's). The engine holds
them and never changes after its constructor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tetrad.comm import Comm
from tetrad.mesh import Mesh
from tetrad.models.batch import Microbatch
from tetrad.parallel.runner import Denominator, GradSync, Runner, RunResult
from tetrad.parallel.state_adapter import PlainAdapter


class Engine:
    """A model on the mesh and the parts that run, synchronise and checkpoint its steps.

    Slotted: nothing outside the constructor can add to it or patch its methods.
    """

    __slots__ = ("model", "mesh", "comm", "runner", "grads", "state", "replicated")
    __slots__ += ("last_run", "_step_hooks", "whole_grads")

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        comm: Comm,
        runner: Runner,
        grads: GradSync,
        state: PlainAdapter,
        replicated: dict[str, tuple[str, ...]],
    ):
        self.model, self.mesh, self.comm = model, mesh, comm
        self.runner, self.grads, self.state = runner, grads, state
        # optimizer tensor -> axes its value is replicated over: counted once in the norm
        self.replicated = replicated
        # data parallelism alone: once reduced, every rank holds the whole gradient, the
        # same on each (an all-reduce's result), so each takes the norm itself
        self.whole_grads = mesh.ep == 1 and all(
            size == 1 for axis, size in mesh.degrees.items() if axis != "dp"
        )
        self.last_run: RunResult | None = None
        # called right after each optimizer step, before `grads.after_step` (measurement)
        self._step_hooks: list[Callable[[], None]] = []

    @property
    def device(self) -> torch.device:
        """The compute device (the one the collectives take tensors on)."""
        return self.comm.device

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The tensors the optimizer updates, with their logical names."""
        return self.grads.params()

    @property
    def loss_owner(self) -> bool:
        """Whether this rank's loss contribution is counted (once per data rank)."""
        return self.mesh.coord["tp"] == 0 and self.runner.holds_loss

    def forward_backward(
        self, micro: list[Microbatch], denom: Denominator, record: bool = True
    ) -> torch.Tensor:
        """Accumulate gradients of sum(token losses)/denom; return this rank's loss share.
        `record`: keep the run as `last_run` (a training step's; an evaluation's is not)."""
        run = self.runner.run(micro, denom, self.grads)
        if record:
            self.last_run = run
        return run.loss

    def launch_grads(self) -> None:
        """Launch every gradient reduction backward did not (`whole_grads` only: what is
        launched after this, on any rank, then follows all of them)."""
        self.grads.launch_rest()

    def sync_grads(self) -> None:
        """Wait for every gradient reduction of the step."""
        self.grads.finish()

    @torch.no_grad()
    def grad_sq_norm(self, whole: bool = False) -> torch.Tensor:
        """Sum of squared gradient entries this rank owns (float64, on the device); summed
        over the world, the squared norm of the single-process gradient. `whole` (with
        `whole_grads`): of every gradient this rank holds, the whole squared norm itself.

        One foreach kernel over the owned gradients, each tensor's norm taken in float64:
        a Python loop of cast, square and sum per parameter cost a millisecond a step on
        a small model, more than the rest of the step's bookkeeping together."""
        coord = self.mesh.place  # the axes, and the expert groups' indices
        grads = [
            p.grad
            for name, p in self.named_parameters()
            if p.grad is not None and (whole or all(coord[a] == 0 for a in self.replicated[name]))
        ]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
        return torch.stack(norms).square().sum()

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient by `factor` (clipping), in one foreach kernel."""
        grads = [p.grad for _, p in self.named_parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    def on_step(self, hook: Callable[[], None]) -> None:
        """Call `hook` right after every optimizer step, before `grads.after_step` (when
        parameters, gradients and optimizer state are all alive: a measurement's moment)."""
        self._step_hooks.append(hook)

    def after_step(self) -> None:
        for hook in self._step_hooks:
            hook()
        self.grads.after_step()

    # --- checkpoints: the state adapter's --------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every logical parameter, full size, fp32, on CPU (a collective)."""
        return self.state.full_state_dict()

    def load_full(self, params) -> None:
        """Install this rank's slices of full logical parameters (no collective)."""
        self.state.load_full(params)

    def owned_slices(self, optimizer: torch.optim.Optimizer):
        """The boxes of the logical state this rank alone writes, copied; and Adam's step."""
        owned, step = self.state.owned_slices(optimizer, self.replicated)
        return owned + self.state.owned_buffers(), step

    def load_owned(self, read, step: int, optimizer: torch.optim.Optimizer) -> None:
        """Fill this rank's state box by box from `read(key, box)` (no collective)."""
        self.state.load_owned(read, step, optimizer)
        self.state.load_buffers(read)

    def after_load(self) -> None:
        """The collective end of a load (ZeRO-1/2 gather their compute weights)."""
        self.state.after_load()
