"""The training loop: one optimizer step at a time, the same code for every layout."""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tetrad.comm import Comm
from tetrad.comm.watchdog import nccl_environment
from tetrad.config import Config
from tetrad.devices import peak_tflops, pick
from tetrad.errors import rank_and_attempt
from tetrad.layout import Layout
from tetrad.mesh import Mesh
from tetrad.models.families import spec_for
from tetrad.parallel import parallelize
from tetrad.parallel.model_state import measure_at_each_step, model_state_bytes
from tetrad.parallel.pipeline.split_costs import resolve_split
from tetrad.parallel.runner import Denominator
from tetrad.train import checkpoint
from tetrad.train.balance import ExpertBalance
from tetrad.train.data import Loader, source_of
from tetrad.train.local_checkpoint import LocalCheckpoints
from tetrad.train.metrics import CompileCost, MetricsWriter, peak_memory_bytes
from tetrad.train.optim import build_optimizer, lr_at, set_lr
from tetrad.train.stop import Preempted, StopRequest
from tetrad.train.straggler import StragglerWatch


@dataclass
class StepResult:
    """What one step did, agreed on by every rank."""

    loss: float
    grad_norm: float
    tokens: int
    skipped: bool
    stop: bool = False  # a rank was asked to stop (a signal): all stop after this step
    writes_done: bool = True  # no rank is still writing an asynchronous checkpoint


def pick_device(cfg: Config) -> torch.device:
    """This rank's compute device, validated (see `devices.pick`); made current on a GPU."""
    t = cfg.train
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick(t.device, t.dtype, t.peak_tflops, local_ranks, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_distributed(
    cfg: Config, layout: Layout, timeout_s: float = 600.0
) -> tuple[Mesh, torch.device]:
    """Join the process group torchrun set up (if any) and build the mesh of `layout`
    (validated for this world: `Layout.build`, before the first collective).

    `timeout_s` bounds the process group's own waits, every group's (a `new_group` without
    one would get torch's default, 30 minutes); tetrad's watchdog (`--timeout`), set
    shorter, names a stuck collective first. On NCCL, async error handling and the flight
    recorder are switched on before the group exists (`nccl_environment`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, attempt = rank_and_attempt()
    timeout = timedelta(seconds=timeout_s)
    if layout.world != world:
        raise ValueError(f"the layout is for {layout.world} ranks, torchrun started {world}")
    device = pick_device(cfg)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            nccl_environment()  # read by the process group when it is created
        # keys of this torchrun attempt only: a restarted rank must never find the address
        # a killed rank of an earlier attempt published in a store that outlived it
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"tetrad/attempt{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return Mesh.build(layout, rank, timeout), device


def use_compile_cache(default: Path) -> None:
    """Inductor's caches (FX graphs, AOT autograd) in $TORCHINDUCTOR_CACHE_DIR if the user
    set it, else in `default` (the run's OUT/compile_cache): a restart loads the compiled
    blocks instead of compiling them again. (Inductor writes its own default into the
    variable on first use, so that value counts as unset.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(default.resolve())


def hf_weights(cfg: Config):
    """The Hugging Face weights to start from (None: tetrad's own init), every tensor's
    name, shape and dtype checked against the configured model."""
    if not cfg.model.init_from_hf:
        return None
    from tetrad.interop import hf

    hf.check_model(cfg.model.init_from_hf, cfg.model)
    return hf.HFWeights(cfg.model.init_from_hf, cfg.model)


class Trainer:
    """Builds the engine, optimizer and loader for this rank, and runs steps."""

    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        device: torch.device,
        comm: Comm | None = None,
        stop: StopRequest | None = None,
        layout: Layout | None = None,
    ):
        """`layout`: `cfg`'s, already built for this world (built, so validated, here if not)."""
        layout = layout or Layout.build(cfg, mesh.world)
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.comm = comm or Comm(device)
        if self.comm.device != torch.device(device):
            raise ValueError(f"Comm is for {self.comm.device}, the trainer computes on {device}")
        self.stop = stop or StopRequest()  # installed on signals by `run`, not here
        # bad data or weights fail here, alike on every rank, before the first collective
        t, batch = cfg.train, mesh["batch"]  # ranks reading different sequences
        heldout = t.eval_batches * t.global_batch if t.eval_every else 0
        source = source_of(cfg, heldout)
        hf = hf_weights(cfg)
        # --pp-split measured: timed and agreed here; the layout holds the split from now
        # on, and checkpoints record it from there (`checkpoint.run_record`)
        layout = self.layout = resolve_split(layout, cfg.model, t, self.comm, mesh["world"], device)
        self.saver = checkpoint.Saver(cfg.checkpoint.async_save, layout)
        if t.compile:
            use_compile_cache(Path(t.out) / "compile_cache")
        self.compile_cost = CompileCost() if t.compile else None
        self.engine = parallelize(layout, cfg.model, t, mesh, self.comm, device)
        if hf is not None:
            self.engine.load_full(hf)  # each rank reads only its slices
            self.engine.state.load_buffers(hf.read_buffer)  # a trained routing bias
        self.optimizer = build_optimizer(self.engine.named_parameters(), cfg.train)
        self.balance = ExpertBalance(self.engine, cfg, mesh)  # MoE models only
        self.straggler = StragglerWatch(cfg.train, mesh, self.comm)  # compute time per rank
        cp = mesh["cp"]  # each cp rank then keeps its two chunks of every sequence
        split = (batch.rank, batch.size, layout.microbatches, cp.rank, cp.size)
        self.loader = Loader(source, t.global_batch, t.seq_len, *split)
        # the held-out split: never in a training batch (see TokenStream, Synthetic)
        self.eval_loader = replace(self.loader, source=source.heldout_split()) if heldout else None
        self.step = 0
        # in-memory checkpoints with a partner copy (a collective: the partner group)
        local = cfg.checkpoint.local_every > 0
        self.local = LocalCheckpoints(cfg, self.engine, self.comm, layout) if local else None
        self.resumed: dict[str, Any] = {}  # how this run resumed: in its first metrics row
        self.flops_per_token = spec_for(cfg.model).flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak = cfg.train.peak_tflops or peak_tflops(device, cfg.train.dtype)
        self.model_state = model_state_bytes(layout, cfg.model, mesh.rank).total  # exact
        # measured at every optimizer step: the live model-state tensors at the step boundary
        self.measured_state = measure_at_each_step(self.engine, self.optimizer)

    def train_step(self) -> StepResult:
        """One optimizer step over the global batch.

        Scalars stay on the compute device (NCCL reduces device tensors only) and the host
        waits for the device once: when every rank reads the agreed loss, norm and token
        count to decide, alike, whether to step.
        """
        self.balance.begin_step()
        self.straggler.start()
        agreed, count = self._forward_backward(self.loader.next())
        self.straggler.stop()
        # the host sync (watched: on a GPU a hung collective shows here, not in its call);
        # the flags: a stop was asked for, a checkpoint writer is busy
        with self.comm.watching("the step's host sync"):
            values = torch.cat([agreed, count.view(1)]).tolist()
        loss, sq_norm, stops, writing, *moe, tokens = values
        self.balance.take(agreed[4:], moe)  # MoE: the expert loads, summed over the world
        norm = math.sqrt(sq_norm)
        skipped = not (math.isfinite(loss) and math.isfinite(norm))
        if not skipped:
            self._apply(norm)
        self.engine.zero_grad()
        self.step += 1
        return StepResult(loss, norm, int(tokens), skipped, stops > 0, writing == 0)

    def _token_count(self, micro) -> Denominator:
        """The global batch's target count, the loss's divisor. From a source with padding
        (its `padded`; its held-out split's is the same) it is all-reduced over the data
        ranks while the first forward runs; without (a token stream, every target a token)
        it is the global batch's size, known to every rank: no collective, each rank
        checking that its own share is whole."""
        tokens = sum(mb.tokens for mb in micro)
        if self.loader.source.padded:
            count = torch.tensor(float(tokens), dtype=torch.float64, device=self.device)
            return Denominator(count, self.comm.all_reduce(count, self.mesh["data"], async_op=True))
        whole = sum(mb.targets.numel() for mb in micro)
        if tokens != whole:
            raise RuntimeError(
                f"{whole - tokens} of this rank's {whole} targets are padding, from a data "
                "source that declares none (its `padded`)"
            )
        full = float(self.cfg.train.global_batch * self.cfg.train.seq_len)
        return Denominator(torch.tensor(full, dtype=torch.float64, device=self.device))

    def _forward_backward(self, micro, record: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of the global batch's mean token loss; ([loss, grad norm^2, flags,
        MoE loads], token count), agreed by every rank, still on the device.

        Nothing here blocks before backward is done: the token count is known, or
        all-reduced while the first forward runs (`_token_count`), and the step's scalars
        ride one all-reduce after the gradients'. With data parallelism alone
        (`Engine.whole_grads`) that one is launched behind the last bucket and each rank
        takes the norm of its whole, reduced gradient meanwhile; otherwise each rank's
        share of the norm rides it too."""
        f64 = dict(dtype=torch.float64, device=self.device)
        denom = self._token_count(micro)
        loss_share = self.engine.forward_backward(micro, denom, record)
        denom.value()  # a rank that holds no loss never divided: the count must land
        own_loss = loss_share if self.engine.loss_owner else torch.zeros((), **f64)
        # a stop request and a busy checkpoint writer ride on the same all-reduce, and the
        # MoE layers' routing statistics (empty without MoE): no collective of their own
        flags = torch.tensor([float(self.stop.requested), float(self.saver.writing)], **f64)
        scalars = torch.cat([own_loss.view(1), flags, self.balance.local()])
        world = self.mesh["world"]
        if self.engine.whole_grads:
            self.engine.launch_grads()  # so that every rank issues the scalars' after them
            pending = self.comm.all_reduce(scalars, world, async_op=True)
            self.engine.sync_grads()
            sq_norm = self.engine.grad_sq_norm(whole=True)
            pending.wait()
        else:
            self.engine.sync_grads()
            scalars = torch.cat([scalars, self.engine.grad_sq_norm().view(1)])
            self.comm.all_reduce(scalars, world)
            sq_norm, scalars = scalars[-1], scalars[:-1]
        return torch.cat([scalars[:1], sq_norm.view(1), scalars[1:]]), denom.count

    def evaluate(self) -> float:
        """Mean token loss over `eval_batches` global batches of the held-out split.

        Each batch takes the training step's own path with the update skipped (the path a
        non-finite step takes): every layout, pipeline schedules included, evaluates
        unchanged, at the price of a backward pass nobody uses."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for k in range(self.cfg.train.eval_batches):  # `last_run` stays the training step's
            agreed, count = self._forward_backward(self.eval_loader.batch(k), False)
            self.engine.zero_grad()
            total += torch.stack([agreed[0] * count, count])
        with self.comm.watching("evaluation's host sync"):
            loss_sum, tokens = total.tolist()
        return loss_sum / max(tokens, 1.0)

    def _apply(self, norm: float) -> None:
        clip = self.cfg.train.grad_clip
        if clip > 0 and norm > clip:
            self.engine.scale_grads(clip / (norm + 1e-6))
        set_lr(self.optimizer, lr_at(self.step, self.cfg.train))
        self.optimizer.step()
        self.engine.after_step()

    def metrics(self, result: StepResult, seconds: float, comm_bytes: float) -> dict[str, Any]:
        """The metrics.jsonl row: sums and maxima over ranks come from two small collectives
        (at a straggler window's end, the sum also gathers every rank's compute time)."""
        window = self.straggler.slots(self.step)  # [] unless a window ends here
        summed = torch.tensor([comm_bytes, *window], dtype=torch.float64, device=self.device)
        self.comm.all_reduce(summed, self.mesh["world"])
        run = self.engine.last_run
        measured = self.measured_state[-1].total if self.measured_state else 0
        self.measured_state[:-1] = []  # only the latest is read
        compiled = self.compile_cost.read() if self.compile_cost else ()
        maxed = torch.tensor(
            [float(peak_memory_bytes(self.device)), seconds, float(self.model_state),
             float(measured), float(run.peak_activation_bytes if run else 0), *compiled],
            dtype=torch.float64,
            device=self.device,
        )  # fmt: skip
        self.comm.all_reduce(maxed, self.mesh["world"], op="max")
        step_time = float(maxed[1])
        tokens_per_s = result.tokens / step_time if step_time > 0 else 0.0
        row = {
            "step": self.step - 1,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": lr_at(self.step - 1, self.cfg.train),
            "tokens": result.tokens,
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * self.flops_per_token / (self.mesh.world * self.peak * 1e12),
            "peak_mem_bytes": int(maxed[0]),
            # saved for backward, at the step's peak (a saved-tensor meter, any device)
            "peak_activation_bytes": int(maxed[4]),
            # parameters, gradients, optimizer state: the live tensors after the optimizer
            # step, and what parallel/memory predicts for them (equal, to the byte)
            "model_state_bytes": int(maxed[3]),
            "model_state_predicted_bytes": int(maxed[2]),
            "comm_bytes": float(summed[0]),
            "skipped": result.skipped,
        } | self._epoch()
        if compiled:  # the most any rank spent compiling this step, and recompiled
            row |= {"compile_s": float(maxed[5]), "recompiles": int(maxed[6])}
        row |= self.straggler.observe(summed[1:].tolist())  # {} unless a window ended
        return row | self.balance.metrics()  # MoE: expert load, from the step's own sync

    def _epoch(self) -> dict[str, float]:
        """Passes made over a token corpus (synthetic data has none)."""
        source = self.loader.source
        return {"epoch": source.epochs(self.step)} if hasattr(source, "epochs") else {}

    def fit(self, writer: MetricsWriter | None = None, stop: int | None = None) -> list[dict]:
        """Run the remaining steps (until `stop`, if given: an interrupted job's stand-in);
        rank 0 writes the metrics; checkpoints every `checkpoint.every` and at the end.

        A stop request (a signal on any rank) ends every rank after the same step: the state
        is saved and `Preempted` raised."""
        rows = []
        end = self.cfg.train.steps if stop is None else min(stop, self.cfg.train.steps)
        with self.stop.deferred():  # from here a signal is agreed on, and saved for
            while self.step < end:
                self.comm.reset()
                t0 = time.perf_counter()
                result = self.train_step()
                seconds = time.perf_counter() - t0
                row = self.metrics(result, seconds, self.comm.total_bus_bytes())
                every = self.cfg.train.eval_every
                if every and (self.step % every == 0 or self.step == self.cfg.train.steps):
                    row["eval_loss"] = self.evaluate()
                if self.local is not None:  # due: the generation in flight committed first
                    row |= self.local.after_step(self.step, self.optimizer, self.loader)
                if not rows and self.resumed:
                    row |= self.resumed | {"first_step_at": time.time()}
                rows.append(row)
                if writer is not None and self.mesh.rank == 0:
                    writer.write(row)
                if result.writes_done:
                    self.saver.finish(self.engine, self.cfg)  # every rank's file is written
                if self._checkpoint_due():
                    self.save_checkpoint()
                if result.stop:
                    if self.local is not None:
                        self.local.close(finished=False)
                    path = self.save_checkpoint(wait=True)
                    raise Preempted(self.step, path, self.stop.signum or signal.SIGTERM)
            self.saver.finish(self.engine, self.cfg)
            if self.local is not None:  # a finished run's in-memory generations are freed
                self.local.close(finished=self.step == self.cfg.train.steps)
            return rows

    def _checkpoint_due(self) -> bool:
        """Every `checkpoint.every` steps, and at the last step (unless `checkpoint.final`
        is off and no cadence is set): a finished run leaves its model."""
        c, last = self.cfg.checkpoint, self.step == self.cfg.train.steps
        return (c.every > 0 and (self.step % c.every == 0 or last)) or (c.final and last)

    def save_checkpoint(self, wait: bool = False) -> Path:
        """Checkpoint the state after `self.step` steps (a collective: every rank calls);
        with `checkpoint.async_save`, written in the background unless `wait`."""
        root = checkpoint.checkpoint_root(self.cfg)
        args = (root, self.step, self.engine, self.optimizer, self.loader, self.cfg)
        return self.saver.save(*args, wait=wait)

    def resume(self) -> int | None:
        """Continue from the newest valid checkpoint if `checkpoint.resume` (every rank calls):
        parameters and AdamW state resliced for this layout, the step (and with it the LR
        schedule), the data position and the RNG. An in-memory generation at least as new
        as the newest durable checkpoint is taken first. Returns its step; None: a fresh
        start."""
        t0 = time.perf_counter()
        root = checkpoint.checkpoint_root(self.cfg)
        step, source = self._resume_from_memory(root), "memory"
        if step is None:
            args = (root, self.engine, self.optimizer, self.loader, self.cfg)
            step, source = checkpoint.restore_newest(*args), "checkpoint"
        if step is not None:
            self.step = step
            self.resumed = {"resumed_from": source, "resumed_step": step}
            self.resumed["world"] = self.mesh.world  # elastic: may differ from before
            self.resumed["resume_load_s"] = time.perf_counter() - t0
        return step

    def _resume_from_memory(self, root: Path) -> int | None:
        """The newest complete in-memory generation, if there is one at least as new as the
        newest durable checkpoint (agreed by every rank); None otherwise."""
        if self.local is None or not self.cfg.checkpoint.resume:
            return None
        durable = checkpoint.committed(root)
        newest = int(durable[-1].name[5:]) if durable else -1
        try:
            step = self.local.restore(self.optimizer, self.loader, newer_than=newest - 1)
        except checkpoint.CorruptCheckpoint as e:  # agreed: every rank falls back alike
            self.local.warn(f"tetrad: warning: in-memory checkpoint unusable ({e}); "
                            "resuming from the durable checkpoint", agreed=True)  # fmt: skip
            return None
        if step is not None and self.mesh.rank == 0:
            print(f"tetrad: resumed from memory at step {step} ({self.local.root})", flush=True)
        return step
