"""tetrad's ZeRO-3 against PyTorch's FSDP2 (`fully_shard`), side by side.

Same model (tetrad's Llama: 8 layers, dim 128, 4 heads, 2 kv heads, vocab 256), same
batches (16 x 128 tokens of the standard-library corpus per step), same optimizer step
(see harness.py) and loss semantics, same world (gloo, 1 thread per rank), in the same
processes. FSDP2 shards each transformer block and then the root, as torchtitan does,
with its defaults (reshard after forward, implicit prefetching); tetrad runs its ZeRO-3
with its defaults (the same policy). Both start from the same weights, so their losses
must agree.

Each side is built and warmed up (`--warmup` steps) under harness.py's memory instrument:
peak live tensor bytes per rank in the c10 CPU allocator, over the warm-up steps
(`peak_step_bytes`) and over construction too (`peak_build_bytes`). Then timed rounds of
`--steps` steps alternate between them (harness.py: ratios, spreads).

Bytes per step: the buffer bytes each rank hands to collectives in one steady step
(all-gather: the gathered output; reduce-scatter: the full input), and the ring's bus
bytes ((n-1)/n of those). tetrad's come from its comm counters (its last step); FSDP2's
from harness.py's collective counter over its last warm-up step.

    .venv/bin/python benchmarks/fsdp.py            # fsdp 2 and 4, prints JSON
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

import harness
from tetrad.config import Config, from_dict, model_preset
from tetrad.layout import Layout
from tetrad.models.flops import param_count
from tetrad.parallel.model_state import measure_at_each_step, model_state_bytes, zero_formula_bytes
from tetrad.testing import spawn


def memory_table(rank: int, world: int, cfg: Config) -> list[dict[str, Any]]:
    """Model state per rank, measured at the optimizer step vs predicted, for every stage
    and dtype (one step each), with the ZeRO paper's formula beside it."""
    rows = []
    for dtype, (p, g, k) in (("fp32", (4, 4, 8)), ("bf16", (2, 2, 12))):
        for stage in (1, 2, 3):
            job = from_dict(cfg.to_dict())
            job.parallel.zero_stage, job.train.dtype = stage, dtype
            trainer, step = harness.tetrad_trainer(job, rank, fsdp=world)
            found = measure_at_each_step(trainer.engine, trainer.optimizer)
            step()
            predicted = model_state_bytes(Layout.build(job), job.model, rank)
            formula = zero_formula_bytes(param_count(job.model), world, stage, p, g, k)
            same = torch.tensor([float(found[-1] == predicted)])
            dist.all_reduce(same, op=dist.ReduceOp.MIN)  # exact on every rank
            rows.append(
                {
                    "stage": stage,
                    "dtype": dtype,
                    "measured_rank0": vars(found[-1]),
                    "predicted_rank0": vars(predicted),
                    "formula": {k: int(v) for k, v in vars(formula).items()},
                    "measured_equals_predicted_on_every_rank": bool(same.item()),
                }
            )
    return rows


def worker(rank: int, world: int, cfg_dict: dict, steps: int, warmup: int, rounds: int) -> dict:
    """Both implementations on this rank: measured warm-up, then alternating timed rounds."""
    cfg = from_dict(cfg_dict)
    states: list = []  # tetrad's model state, measured at each optimizer step

    def make_tetrad():
        trainer, step = harness.tetrad_trainer(cfg, rank, fsdp=world)
        states.append(measure_at_each_step(trainer.engine, trainer.optimizer))
        return trainer, step

    makers = {
        "tetrad": make_tetrad,
        "fsdp2": lambda: harness.side(harness.FSDP2Runner(cfg, rank, world)),
    }
    counter = harness.CollectiveCounter(world)
    sides, out = harness.race(makers, warmup, steps, rounds, around={"fsdp2": counter})
    return out | {
        "tetrad_comm": sides["tetrad"].comm.summary(),
        "fsdp2_comm": counter.summary(),
        "model_state": states[0][-1].total,
        "memory_table": memory_table(rank, world, cfg),
    }


def summarize(world: int, cfg: Config, out: dict, steps: int) -> dict[str, Any]:
    """One row of the result: throughput, ratio, peak memory, bytes per step, losses."""
    tet = [out["tetrad_comm"][f"fsdp/{op}"] for op in ("all_gather", "reduce_scatter")]
    peer = [out["fsdp2_comm"]["by_kind"][op] for op in ("all_gather", "reduce_scatter")]
    t_loss = out["losses"]["tetrad"]
    return {
        "fsdp": world,
        **harness.timing(out["seconds"], cfg, steps),
        **harness.memory(out["peaks"]),
        "tetrad_model_state_bytes": out["model_state"],
        "tetrad_bytes_per_step": sum(c["bytes"] for c in tet),
        "fsdp2_bytes_per_step": sum(c["bytes"] for c in peer),
        "tetrad_bus_bytes_per_step": sum(c["bus_bytes"] for c in tet),
        "fsdp2_bus_bytes_per_step": sum(c["bus_bytes"] for c in peer),
        "fsdp2_uncounted_ops": out["fsdp2_comm"]["uncounted"],
        "losses_max_rel_diff": max(harness.rel_diffs(t_loss, out["losses"]["fsdp2"])),
        "final_loss": t_loss[-1],
        "memory_table": out["memory_table"],
    }


def main() -> None:
    args = harness.arguments(__doc__, "--worlds", steps=3, rounds=4, warmup=2).parse_args()
    model = asdict(model_preset("small")) | {"layers": 8}
    rows = []
    for world in args.worlds:
        total = args.warmup + args.rounds * args.steps
        cfg = harness.job(model, {"fsdp": world, "zero_stage": 3}, total)
        out = spawn(worker, world, cfg.to_dict(), args.steps, args.warmup, args.rounds,
                    timeout=1200)[0]  # fmt: skip
        rows.append(summarize(world, cfg, out, args.steps))
    harness.report("fsdp", cfg, rows, zero_stage=3, dtype="fp32", steps_per_round=args.steps,
                   rounds=args.rounds, memory_measure="peak live tensor bytes, c10 CPU "
                   "allocator via torch.profiler")  # fmt: skip


if __name__ == "__main__":
    main()
