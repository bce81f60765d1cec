"""tetrad's expert parallelism against experts replicated over data parallelism, and
against a plain-PyTorch expert parallelism, side by side.

Four sides, in the same processes, on the same model (tetrad's MoE, "moe-small": 4
layers of which 3 MoE, dim 128, 8 experts of 128, top-2, one shared expert), the same
batches (`--batch` sequences of 128 tokens of the standard-library corpus per step),
the same initial weights and optimizer step (harness.py), gloo, 1 thread per rank:

- `ep`: tetrad, `--dp N --ep N`: each rank holds E/N experts; tokens go to their experts'
  ranks and back by all-to-all (parallel/expert.py), the shared expert computing while
  the tokens travel; expert gradients need no all-reduce (ep spans every data rank).
- `ep_no_overlap`: the same with the shared expert run after the tokens arrive instead of
  while they travel: the exposed all-to-all wait with and without that overlap.
- `replicated`: tetrad, `--dp N`: every rank holds all E experts, whose gradients are
  all-reduced with the rest (what EP is compared against).
- `peer`: expert parallelism as a PyTorch user writes it without a framework: the full
  model built, each rank keeping its E/N experts, a dispatcher that exchanges the counts
  with `dist.all_to_all_single`, then moves the rows with the autograd-aware
  `torch.distributed.nn.functional.all_to_all_single` (torchtitan's all-to-all token
  dispatcher has this shape), both on an ep process group of their own, and DDP for
  every other parameter (experts left out of it, gradients summed by a comm hook, as
  tetrad's loss is already divided by the global token count).

Why not torchtitan's MoE with its expert-parallel style: torchtitan 0.3.0 installs from the
package index without touching torch, but its MoE layer imports torchtitan's whole
configuration stack (tyro, torchdata, datasets, spmd_types), and its all-to-all
dispatcher is wired to the ep mesh by its decoder's sharding pass inside its trainer
(ParallelDims, spmd_types placements), a trainer that cannot train on a CPU-only torch
(none of its attention backends has a CPU backward). Run on its own, the layer would be
torchtitan's code wired by our hand, not torchtitan as its users run it; so the peer is
the plain-PyTorch expert parallelism above, on tetrad's very model and batch.

Each side is built and warmed up (`--warmup` steps) under harness.py's memory instrument
(peak live tensor bytes per rank, max over ranks), then timed blocks of `--steps` steps
rotate between the four for `--rounds` rounds; a ratio is the median of the rounds'
ratios, with its spread (harness.spread: interquartile range, bootstrap 95% interval).

Bytes: tetrad's all-to-all bytes sent per rank in one step come from its comm counters
(`ep/all_to_all`: the rows that leave the rank; `ep/all_to_all_counts`: the counts),
set against docs/moe.md's formula under uniform routing, 4 · T · k · dim · 4 · (N−1)/N
per MoE layer for a rank's T tokens; the peer's rows leaving the rank are counted in its
dispatcher in forward (its backward sends the same rows back). The gradient all-reduce
bytes (`data/all_reduce`) show what the replicated experts cost instead. Exposed
all-to-all: the seconds rank 0's steps spent blocked in `ep/all_to_all` (Comm's clock),
per timed step.

    .venv/bin/python benchmarks/moe.py              # worlds 2 and 4, prints JSON
    .venv/bin/python benchmarks/moe.py --worlds 2 --shared-experts 4   # more to overlap
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import harness
from tetrad.config import Config, from_dict, model_preset
from tetrad.mesh import Mesh
from tetrad.models.init import materialize
from tetrad.models.llama import cross_entropy_sum
from tetrad.models.moe import Experts, meta_moe, moe_layers, set_aux_scale
from tetrad.parallel.expert import expert_layers
from tetrad.testing import spawn
from tetrad.train.loop import Trainer

SIDES = ("ep", "ep_no_overlap", "replicated", "peer")


class TetradSide:
    """tetrad's Trainer at dp=world and `ep`, its step (comm counters per step), and the
    seconds each step spent blocked in the token all-to-alls. `overlap=False` takes the
    shared expert off the dispatch's wait (it then runs after the tokens arrive)."""

    def __init__(self, cfg: Config, rank: int, world: int, ep: int, overlap: bool = True):
        cfg = replace(cfg, parallel=replace(cfg.parallel, ep=ep))
        mesh = Mesh.build(cfg.parallel, rank)
        self.trainer = Trainer(cfg, mesh, torch.device("cpu"))
        self.comm, self.blocked = self.trainer.comm, []
        if not overlap:
            for _, layer in expert_layers(self.trainer.engine.model):
                layer.dispatch.shared = None

    def train_step(self) -> float:
        """One optimizer step; returns its loss."""
        self.comm.reset()
        loss = self.trainer.train_step().loss
        self.blocked.append(self.comm.summary().get("ep/all_to_all", {}).get("seconds", 0.0))
        return loss


# --- the peer: expert parallelism in plain PyTorch ----------------------------------------


class PlainEPDispatch:
    """The MoE layer's dispatch protocol (`d(x, ids, weights, experts) -> out`) over all
    ranks: copies sorted by expert, counts exchanged, rows to the experts' ranks and back
    with the autograd all-to-all, weighted and summed per token."""

    def __init__(self, experts_total: int, counted: dict[str, int], group):  # noqa: ANN001
        self.n, self.counted, self.group = experts_total, counted, group
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts
    ) -> torch.Tensor:
        tokens, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        local = self.n // self.world
        send = torch.bincount(flat, minlength=self.n)  # [rank · local expert]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # [source rank · local expert]
        send_rows = send.view(self.world, local).sum(1).tolist()
        recv_rows = recv.view(self.world, local).sum(1).tolist()
        arrived = self._exchange(x[order // k], recv_rows, send_rows)
        # arrived by source rank then expert: regrouped by expert for the grouped matmul
        expert_of = torch.arange(local).repeat(self.world).repeat_interleave(recv)
        regroup = torch.argsort(expert_of, stable=True)
        out = experts(arrived[regroup], recv.view(self.world, local).sum(0))
        if not out.requires_grad:  # no row arrived (skewed routing): stay in the graph, or
            out = out + arrived.sum() * 0  # this rank skips the backward all-to-alls and hangs
        back = self._exchange(out[torch.argsort(regroup)], send_rows, recv_rows)
        copies = back[torch.argsort(order)].view(tokens, k, -1)
        return (copies * weights.unsqueeze(-1)).sum(1)

    def _exchange(self, rows: torch.Tensor, out_rows: list[int], in_rows: list[int]):
        leaving = sum(in_rows) - in_rows[self.rank]
        self.counted["rows_sent"] += leaving
        self.counted["bytes_sent"] += leaving * rows.shape[1] * rows.element_size()
        out = rows.new_empty((sum(out_rows), rows.shape[1]))
        return dist_fn.all_to_all_single(out, rows.contiguous(), out_rows, in_rows, self.group)


def sum_hook(state: None, bucket):  # noqa: ANN001
    """DDP's all-reduce of one bucket, summed (not averaged): the loss is already divided
    by the global batch's token count. No annotations (DDP compares them to its classes)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class ExpertsAloneOptimizer(harness.PeerOptimizer):
    """The harness's optimizer step, with the norm summing each rank's own experts'
    gradients (held by one rank each) and the replicated rest once."""

    def __init__(self, model: nn.Module, train, expert_params: set[int]):  # noqa: ANN001
        super().__init__(model, train)
        self.alone = expert_params

    def _own_sq(self, grads: list[torch.Tensor], first: bool) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if p.grad is not None and (id(p) in self.alone or first):
                sq += p.grad.double().pow(2).sum()
        return sq


class PlainEPRunner:
    """tetrad's training step with expert parallelism written in plain PyTorch."""

    def __init__(self, cfg: Config, rank: int, world: int):
        model = materialize(meta_moe(cfg.model), cfg.model, cfg.train.seed, "cpu")
        set_aux_scale(model, cfg.train.global_batch)  # the aux loss: a global-batch mean
        self.counted = {"rows_sent": 0, "bytes_sent": 0}
        local = cfg.model.experts // world
        # the ep group, as an ep mesh gives it (here all ranks), apart from DDP's
        ep_group = dist.new_group(list(range(world)))
        expert_names, expert_ids = [], set()
        for i, ffn in moe_layers(model).items():
            for pname in ("w1", "w3", "w2"):
                full = getattr(ffn.experts, pname)
                mine = nn.Parameter(full.detach()[rank * local : (rank + 1) * local].clone())
                setattr(ffn.experts, pname, mine)
                expert_names.append(f"layers.{i}.feed_forward.experts.{pname}")
                expert_ids.add(id(mine))
            ffn.use_dispatch(PlainEPDispatch(cfg.model.experts, self.counted, ep_group))
        DDP._set_params_and_buffers_to_ignore_for_model(model, expert_names)
        self.ddp = DDP(model, broadcast_buffers=False)
        self.ddp.register_comm_hook(None, sum_hook)
        self.optimizer = ExpertsAloneOptimizer(model, cfg.train, expert_ids)
        self.loader = harness.peer_loader(cfg, rank, world)

    def train_step(self) -> float:
        """One optimizer step; returns the global mean token loss."""
        self.counted.update(rows_sent=0, bytes_sent=0)  # they hold the last step
        (mb,) = self.loader.next()
        loss = cross_entropy_sum(self.ddp(mb.inputs), mb.targets) / harness.global_tokens([mb])
        loss.backward()
        return self.optimizer.step(loss)


# --- the run ------------------------------------------------------------------------------


def worker(rank: int, world: int, cfg_dict: dict, steps: int, warmup: int, rounds: int) -> dict:
    """The three sides on this rank: measured warm-up, then rotating timed rounds."""
    cfg = from_dict(cfg_dict)
    makers = {
        "ep": lambda: harness.side(TetradSide(cfg, rank, world, ep=world)),
        "ep_no_overlap": lambda: harness.side(TetradSide(cfg, rank, world, world, False)),
        "replicated": lambda: harness.side(TetradSide(cfg, rank, world, ep=1)),
        "peer": lambda: harness.side(PlainEPRunner(cfg, rank, world)),
    }
    sides, out = harness.race(makers, warmup, steps, rounds)
    comm = {name: sides[name].comm.summary() for name in ("ep", "replicated")}
    timed = rounds * steps  # the blocked seconds of the timed steps, each rank's
    blocked = {name: sides[name].blocked[-timed:] for name in ("ep", "ep_no_overlap")}
    return out | {"comm": comm, "peer_counted": dict(sides["peer"].counted), "blocked": blocked}


def a2a_formula(cfg: Config, world: int) -> float:
    """docs/moe.md: bytes sent per rank per step by the token all-to-alls under uniform
    routing, 4 · T · k · dim · c · (N−1)/N per MoE layer (fp32: c = 4)."""
    m = cfg.model
    tokens = cfg.train.global_batch * cfg.train.seq_len // world  # T, this rank's
    per_layer = 4 * tokens * m.top_k * m.dim * 4 * (world - 1) / world
    return per_layer * (m.layers - m.dense_layers)


def throughput(seconds: dict[str, list[tuple[float, float]]], cfg: Config, steps: int) -> dict:
    """tokens/s of each side (medians and rounds) and ep's ratios to the other two."""
    tokens = cfg.train.global_batch * cfg.train.seq_len * steps
    tps = {k: [tokens / wall for wall, _ in v] for k, v in seconds.items()}
    fields: dict[str, Any] = {}
    for name in SIDES:
        fields[f"{name}_tokens_per_s"] = round(statistics.median(tps[name]), 1)
        fields[f"{name}_tokens_per_s_rounds"] = [round(x, 1) for x in tps[name]]
    for other in SIDES[1:]:
        ratios = [a / b for a, b in zip(tps["ep"], tps[other])]
        fields |= harness.ratio_fields(f"ratio_ep_over_{other}", ratios, f"ratio_{other}")
    return fields


def memory(peaks: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Peak tensor bytes per rank of each side (steps; construction and steps), and ep's
    step peak over the others'."""
    fields: dict[str, Any] = {f"{k}_peak_step_bytes": v["step"] for k, v in peaks.items()}
    fields |= {f"{k}_peak_build_bytes": v["build"] for k, v in peaks.items()}
    for other in SIDES[1:]:
        ratio = peaks["ep"]["step"] / peaks[other]["step"]
        fields[f"peak_step_ratio_ep_over_{other}"] = round(ratio, 3)
    return fields


def traffic(cfg: Config, world: int, out: dict) -> dict[str, Any]:
    """Bytes each rank sent in one step: the token all-to-alls (measured, and the formula
    under uniform routing), the counts, and the gradient all-reduces."""
    ep, rep = out["comm"]["ep"], out["comm"]["replicated"]
    formula = a2a_formula(cfg, world)
    sent = ep["ep/all_to_all"]["bus_bytes"]
    return {
        "ep_a2a_sent_bytes_per_step": sent,
        "a2a_formula_uniform_bytes_per_step": formula,
        "ep_a2a_over_formula": round(sent / formula, 4),
        "ep_a2a_calls_per_step": ep["ep/all_to_all"]["calls"],
        "ep_counts_sent_bytes_per_step": ep["ep/all_to_all_counts"]["bus_bytes"],
        # the peer's backward returns the rows its forward sent: twice the forward count
        "peer_a2a_sent_bytes_per_step": 2 * out["peer_counted"]["bytes_sent"],
        "ep_grad_allreduce_bytes_per_step": ep["data/all_reduce"]["bytes"],
        "replicated_grad_allreduce_bytes_per_step": rep["data/all_reduce"]["bytes"],
    }


def exposed(blocked: dict[str, list[float]]) -> dict[str, Any]:
    """Seconds per step rank 0 spent blocked in the token all-to-alls (forward and
    backward), with and without the shared expert overlapping the dispatch: medians
    and ranges over the timed steps."""
    fields: dict[str, Any] = {}
    for name, seconds in blocked.items():
        fields[f"{name}_a2a_blocked_s_per_step"] = round(statistics.median(seconds), 4)
        fields[f"{name}_a2a_blocked_s_range"] = [round(min(seconds), 4), round(max(seconds), 4)]
    return fields


def summarize(world: int, cfg: Config, out: dict, steps: int) -> dict[str, Any]:
    """One row of the result: throughput, memory, bytes, loss agreement of the sides."""
    losses = out["losses"]
    return {
        "world": world,
        "ep": world,
        "tokens_per_rank_per_step": cfg.train.global_batch * cfg.train.seq_len // world,
        **throughput(out["seconds"], cfg, steps),
        **memory(out["peaks"]),
        **traffic(cfg, world, out),
        **exposed(out["blocked"]),
        "losses_max_rel_diff_ep_vs_replicated": max(
            harness.rel_diffs(losses["ep"], losses["replicated"])
        ),
        "losses_max_rel_diff_peer_vs_replicated": max(
            harness.rel_diffs(losses["peer"], losses["replicated"])
        ),
        "final_loss": losses["ep"][-1],
    }


def main() -> None:
    p = harness.arguments(__doc__, "--worlds", steps=1, rounds=8, warmup=2)
    p.add_argument("--batch", type=int, default=8, help="sequences of 128 tokens per step")
    p.add_argument("--shared-experts", type=int, default=1, help="moe-small's: 1")
    args = p.parse_args()
    model = asdict(model_preset("moe-small")) | {"shared_experts": args.shared_experts}
    rows = []
    for world in args.worlds:
        total = args.warmup + args.rounds * args.steps
        cfg = harness.job(model, {"dp": world}, total, batch=args.batch)
        cfg.train.loss_chunk = 0  # full logits on every side
        out = spawn(worker, world, cfg.to_dict(), args.steps, args.warmup, args.rounds,
                    timeout=1800)[0]  # fmt: skip
        rows.append(summarize(world, cfg, out, args.steps))
    m = cfg.model
    moe = {k: getattr(m, k) for k in ("experts", "top_k", "moe_ffn_dim", "shared_experts")}
    harness.report("moe", cfg, rows, moe=moe | {"dense_layers": m.dense_layers},
                   peer="plain PyTorch EP: all_to_all_single (autograd) + DDP for the rest",
                   steps_per_round=args.steps, rounds=args.rounds)  # fmt: skip


if __name__ == "__main__":
    main()
