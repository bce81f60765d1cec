"""tetrad's data parallelism against PyTorch's DistributedDataParallel, side by side.

Same model (tetrad's Llama, "small" preset: 4 layers, dim 128), same batches (16 x 128
tokens of the standard-library corpus per step), same optimizer step (see harness.py),
loss semantics and initial weights, same world (gloo, 1 thread per rank), in the same
processes. Same loss computation by default: tetrad with full logits (`--loss-chunk 0`),
as DDP's users compute it, so what differs is the data parallelism alone; `--loss-chunk
1024` runs tetrad's default chunked loss instead (its head matmul runs twice). Each side
is built and warmed up (`--warmup` steps, peak memory measured), then timed rounds of
`--steps` steps alternate between them (harness.py: ratios, spreads).

The DDP side takes the usual mean loss over its tokens (the corpus has no padding, so
that is tetrad's loss over the global batch's token count), and the norm of its whole
reduced gradient itself while the loss is all-reduced, as tetrad does with data
parallelism alone. It sums gradients with a comm hook that counts each bucket's bytes
(DDP's own hook averages; tetrad divides the loss by the global token count, so the sum is
the single-process gradient and the two runs' losses must agree). tetrad's bytes come from its
comm counters. Bytes and buckets are those of each side's last step.

    .venv/bin/python benchmarks/dp.py            # worlds 2 and 4, prints JSON
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import harness
from tetrad.config import Config, from_dict, model_preset
from tetrad.models.flops import param_count
from tetrad.models.llama import cross_entropy_sum
from tetrad.parallel.data import first_bucket_bytes
from tetrad.testing import spawn


class DDPRunner:
    """The same training step as tetrad's Trainer, written the usual PyTorch DDP way."""

    def __init__(self, cfg: Config, rank: int, world: int, bucket_cap_mb: float | None = None):
        model = harness.peer_model(cfg)
        self.ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)  # None: DDP's defaults
        self.counts = {"calls": 0, "bytes": 0}
        self.ddp.register_comm_hook(self.counts, counting_sum_hook)
        self.optimizer = harness.PeerOptimizer(model, cfg.train, whole_grads=True)
        self.loader = harness.peer_loader(cfg, rank, world)
        self.world = world

    def train_step(self) -> float:
        """One optimizer step; returns the global mean token loss."""
        self.counts.update(calls=0, bytes=0)  # they hold the last step
        (mb,) = self.loader.next()
        # the mean over this rank's tokens, which DDP's usual averaging hook would then
        # divide by the world (this one sums): the global batch's mean, with no padding
        loss = cross_entropy_sum(self.ddp(mb.inputs), mb.targets) / (mb.tokens * self.world)
        loss.backward()
        return self.optimizer.step(loss)


def counting_sum_hook(state: dict[str, int], bucket):  # noqa: ANN001
    """All-reduce (sum) one DDP bucket (a dist.GradBucket), counting calls and buffer bytes.

    No annotations: DDP compares them to the real classes, and this module's
    `from __future__ import annotations` would turn them into strings.
    """
    buf = bucket.buffer()
    state["calls"] += 1
    state["bytes"] += buf.numel() * buf.element_size()
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def worker(
    rank: int, world: int, cfg_dict: dict, steps: int, warmup: int, rounds: int, cap: float | None
) -> dict:
    """Both implementations on this rank: measured warm-up, then alternating timed rounds."""
    cfg = from_dict(cfg_dict)
    makers = {
        "tetrad": lambda: harness.tetrad_trainer(cfg, rank, dp=world),
        "ddp": lambda: harness.side(DDPRunner(cfg, rank, world, cap)),
    }
    sides, out = harness.race(makers, warmup, steps, rounds)
    return out | {"tetrad_comm": sides["tetrad"].comm.summary(), "ddp_comm": sides["ddp"].counts}


def summarize(world: int, cfg: Config, out: dict, steps: int) -> dict[str, Any]:
    """One row of the result: throughput, ratio, memory, bytes per step, loss agreement."""
    grad, ddp = out["tetrad_comm"]["data/all_reduce"], out["ddp_comm"]
    t_loss = out["losses"]["tetrad"]
    rel = harness.rel_diffs(t_loss, out["losses"]["ddp"])
    return {
        "world": world,
        **harness.timing(out["seconds"], cfg, steps),
        **harness.memory(out["peaks"]),
        # the data group's all-reduces are the gradient buckets alone: the corpus has no
        # padding, so tetrad all-reduces no token count
        "tetrad_grad_bytes_per_step": grad["bytes"],
        "ddp_grad_bytes_per_step": ddp["bytes"],
        "theory_grad_bytes_per_step": 4 * param_count(cfg.model),
        "tetrad_bus_bytes_per_step": grad["bus_bytes"],
        "tetrad_buckets_per_step": grad["calls"],
        "ddp_buckets_per_step": ddp["calls"],
        # the project's bar: relative 1e-5 over 20 steps. Later steps may drift further:
        # with 4 ranks the two bucket layouts make gloo's ring add in different orders.
        "losses_max_rel_diff_20_steps": max(rel[:20]),
        "losses_max_rel_diff_all_steps": max(rel),
        "losses_equal": max(rel[:20]) <= 1e-5,
        "final_loss": t_loss[-1],
    }


def main() -> None:
    p = harness.arguments(__doc__, "--worlds", steps=1, rounds=24, warmup=2)
    p.add_argument("--bucket-mb", type=float, help="tetrad's bucket size (default: its config)")
    p.add_argument("--loss-chunk", type=int, default=0, help="tetrad's (0: full logits, as DDP)")
    p.add_argument(
        "--ddp-bucket-cap-mb",
        type=float,
        help="DDP's bucket_cap_mb (default: DDP's defaults, a 1 MiB first bucket and "
        "25 MiB; given, every bucket is that size, so 25 makes one of this model)",
    )
    args = p.parse_args()
    bucket = {"bucket_mb": args.bucket_mb} if args.bucket_mb is not None else {}
    rows = []
    for world in args.worlds:
        total = args.warmup + args.rounds * args.steps
        cfg = harness.job(asdict(model_preset("small")), {"dp": world} | bucket, total)
        cfg.train.loss_chunk = args.loss_chunk
        out = spawn(worker, world, cfg.to_dict(), args.steps, args.warmup, args.rounds,
                    args.ddp_bucket_cap_mb, timeout=1200)[0]  # fmt: skip
        rows.append(summarize(world, cfg, out, args.steps))
    cpu, bucket_bytes = torch.device("cpu"), int(cfg.parallel.bucket_mb * 2**20)
    harness.report("dp", cfg, rows, tetrad_bucket_mb=cfg.parallel.bucket_mb,
                   tetrad_first_bucket_mb=first_bucket_bytes(cpu, bucket_bytes) / 2**20,
                   tetrad_loss_chunk=args.loss_chunk, ddp_loss="full logits",
                   ddp_bucket_cap_mb=args.ddp_bucket_cap_mb or "default",
                   steps_per_round=args.steps, rounds=args.rounds)  # fmt: skip


if __name__ == "__main__":
    main()
