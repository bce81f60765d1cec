"""tetrad's tensor (+ sequence) parallelism against PyTorch's DTensor tensor parallel.

Same model (tetrad's Llama: 4 layers, dim 128, 8 heads, 4 kv heads, vocab 256), same
batches (16 x 128 tokens of the standard-library corpus per step), same initial weights,
optimizer step (see harness.py) and loss semantics, same world (gloo, 1 thread per rank),
in the same processes, at tp = 2 and 4, with and without sequence parallelism.

The peer is the same tetrad `Llama` module, materialised whole and handed to
`parallelize_module` with DTensor's styles, configured as torchtitan does it:
`ColwiseParallel` for wq/wk/wv/w1/w3 and the output head (logits left vocab-sharded for
`loss_parallel`), `RowwiseParallel` for wo/w2 and the vocab-sharded embedding,
`PrepareModuleInput` so attention and the MLP each enter the tp region once, and with SP
`SequenceParallel` for the norms and sequence-sharded (`Shard(1)`) residuals.

The first step of each side is untimed and measured instead (harness.py's instruments):
peak live tensor bytes from construction through that step (parameters, gradients,
optimizer states, activations, buffers) and, for the peer, its collectives' bytes as a
dispatch mode sees them after DTensor has desugared its ops. tetrad's bytes come from its
comm counters (its last step). "bus" bytes use the ring factors (all-reduce 2(n-1)/n,
all-gather / reduce-scatter (n-1)/n). Then timed rounds of `--steps` steps alternate
between the two (harness.py: ratios, spreads).

    .venv/bin/python benchmarks/tp.py            # tp 2 and 4, with and without SP, JSON
"""

from __future__ import annotations

import time
from typing import Any

import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

import harness
from tetrad.config import Config, from_dict
from tetrad.models.llama import Llama
from tetrad.testing import spawn

MODEL = {"layers": 4, "dim": 128, "heads": 8, "kv_heads": 4, "vocab": 256}


def dtensor_plan(model: Llama, sp: bool) -> dict[str, Any]:
    """DTensor styles for tetrad's Llama (torchtitan's plan; without SP, replicated residuals)."""
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    for name in model.layers:
        p = f"layers.{name}."
        for region, col, row in (("attention", "wq wk wv", "wo"), ("feed_forward", "w1 w3", "w2")):
            plan[p + region] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            )
            plan.update({f"{p}{region}.{c}": ColwiseParallel() for c in col.split()})
            plan[f"{p}{region}.{row}"] = RowwiseParallel(output_layouts=seq)
        if sp:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
    return plan


class DTensorRunner:
    """The same training step as tetrad's Trainer, written the usual DTensor TP way."""

    def __init__(self, cfg: Config, tp: int):
        model = harness.peer_model(cfg)
        self.model = parallelize_module(
            model, init_device_mesh("cpu", (tp,)), dtensor_plan(model, cfg.parallel.sp)
        )
        self.optimizer = harness.PeerOptimizer(self.model, cfg.train)
        self.loader = harness.peer_loader(cfg)  # every tp rank reads the whole batch

    def train_step(self) -> float:
        """One optimizer step; returns the mean token loss."""
        (mb,) = self.loader.next()
        with loss_parallel():
            logits = self.model(mb.inputs)  # DTensor [b, s, V], sharded over the vocabulary
            loss = F.cross_entropy(
                logits.flatten(0, 1), mb.targets.flatten(), reduction="sum", ignore_index=-100
            ) / max(mb.tokens, 1)
            loss.backward()
        return self.optimizer.step(loss.detach().full_tensor(), replicated_loss=True)


def run_pair(rank: int, tp: int, raw: dict, steps: int, rounds: int) -> dict[str, Any]:
    """Both implementations of one layout on this rank: the first step measured, then
    alternating timed rounds."""
    cfg = from_dict(raw)
    makers = {
        "tetrad": lambda: harness.tetrad_trainer(cfg, rank, tp=tp),
        "dtensor": lambda: harness.side(DTensorRunner(cfg, tp)),
    }
    counter = harness.CollectiveCounter(tp)
    sides, out = harness.race(makers, 1, steps, rounds, around={"dtensor": counter})
    return out | {"tetrad_comm": sides["tetrad"].comm.summary(), **counter.summary()}


def worker(rank: int, world: int, raws: list[dict], steps: int, rounds: int) -> list[dict]:
    """Every layout of this world size, one after the other."""
    return [run_pair(rank, world, raw, steps, rounds) for raw in raws]


def summarize(cfg: Config, res: dict, steps: int) -> dict[str, Any]:
    """One row: throughput, ratio, bytes per step, peak memory, loss agreement."""
    tet, peer = res["tetrad_comm"].values(), res["by_kind"].values()
    t_loss, d_loss = res["losses"]["tetrad"], res["losses"]["dtensor"]
    rel = harness.rel_diffs(t_loss, d_loss)
    peaks = {k: v["step"] for k, v in res["peaks"].items()}
    return {
        "tp": cfg.parallel.tp,
        "sp": cfg.parallel.sp,
        **harness.timing(res["seconds"], cfg, steps),
        "tetrad_bytes_per_step": sum(s["bytes"] for s in tet),
        "dtensor_bytes_per_step": sum(s["bytes"] for s in peer),
        "tetrad_bus_bytes_per_step": sum(s["bus_bytes"] for s in tet),
        "dtensor_bus_bytes_per_step": sum(s["bus_bytes"] for s in peer),
        "tetrad_collectives_per_step": sum(s["calls"] for s in tet),
        "dtensor_collectives_per_step": sum(s["calls"] for s in peer),
        "dtensor_uncounted_ops": res["uncounted"],
        "tetrad_peak_mem_bytes": peaks["tetrad"],
        "dtensor_peak_mem_bytes": peaks["dtensor"],
        "mem_ratio_tetrad_over_dtensor": round(peaks["tetrad"] / peaks["dtensor"], 3),
        "first_losses": {"tetrad": t_loss[:3], "dtensor": d_loss[:3]},
        "losses_max_rel_diff_first_3": max(rel[:3]),
        "losses_max_rel_diff_all": max(rel),
        "numerics_equal": max(rel[:3]) <= 1e-5,
    }


def main() -> None:
    args = harness.arguments(__doc__, "--tp", steps=2, rounds=4).parse_args()
    t0 = time.perf_counter()
    rows = []
    for tp in args.tp:
        total = 1 + args.rounds * args.steps
        cfgs = [harness.job(MODEL, {"tp": tp, "sp": sp}, total) for sp in (False, True)]
        results = spawn(worker, tp, [c.to_dict() for c in cfgs], args.steps, args.rounds,
                        timeout=1200)[0]  # fmt: skip
        rows += [summarize(c, r, args.steps) for c, r in zip(cfgs, results)]
    harness.report(
        "tp",
        cfgs[0],
        rows,
        steps_per_round=args.steps,
        rounds=args.rounds,
        peer_bytes="counted: a dispatch mode sums DTensor's collectives (its first step)",
        tetrad_bytes="counted: tetrad's comm layer (every collective of its last step)",
        peak_mem="peak live tensor bytes from construction through the first step, max over "
        "ranks, c10 CPU allocator via torch.profiler for both",
        wall_s=round(time.perf_counter() - t0, 1),
    )


if __name__ == "__main__":
    main()
