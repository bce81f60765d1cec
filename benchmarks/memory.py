"""Memory for models that do not fit: tetrad's activation recomputation against FSDP2 with
`checkpoint_wrapper` (the torchtitan recipe), side by side, at fsdp 2.

Same model (tetrad's Llama: 8 layers, dim 128, 4 heads, 2 kv heads, vocab 256), same
batches (16 x 128 tokens of the standard-library corpus per step), same optimizer step
and loss semantics (harness.py), in the same processes, for each recompute mode:

- none: neither recomputes;
- selective: tetrad's `--recompute selective` (it keeps k, v, the attention output, wo's
  and w1's outputs; models/recompute.py) against FSDP2's blocks under torch's selective
  checkpointing with torchtitan's per-op policy (`selective_ac_option = "op"`: the outputs
  of matmuls, attention kernels, reduce-scatters and max are kept except every second
  matmul), and, a second row, against the same policy keeping every matmul (less
  recomputation, more memory: the fastest selective peer);
- full: tetrad checkpoints every block (`--recompute full`); FSDP2 wraps every block in
  `checkpoint_wrapper` before `fully_shard` (torchtitan's full activation checkpointing).

tetrad runs ZeRO-3; FSDP2 the plain loss over full logits. Each mode runs twice: tetrad with
full logits too (`--loss-chunk 0`: like for like, the same loss code on both sides), then
with its default chunked loss (`loss_chunk` 1024: what the chunked loss adds).
Each side is built and warmed up under harness.py's memory instrument (peak live tensor
bytes per rank in the c10 CPU allocator, over the warm-up steps: one instrument for both),
then timed rounds alternate (ratios with spreads over rounds). tetrad's own saved-tensor
meter (`peak_activation_bytes` in metrics.jsonl) and the planner's prediction of it are
reported beside.

    .venv/bin/python benchmarks/memory.py          # fsdp 2, prints JSON
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from typing import Any

import torch

import harness
from tetrad.config import Config, from_dict, model_preset
from tetrad.layout import Layout
from tetrad.mesh import Mesh
from tetrad.plan.cost import Planner
from tetrad.plan.engines import TETRAD
from tetrad.plan.hardware import cluster_preset
from tetrad.testing import spawn


def _op_sac_policy(every_matmul: bool = False):
    """torchtitan's per-op selective checkpointing policy for one block's checkpoint: keep
    the outputs of the compute-intensive ops (matmuls, the attention kernels, reduce-scatters,
    max) except every second matmul (all of them if `every_matmul`), counted per block and
    separately in the recompute; the rest (norms, rotary, SwiGLU's activation and product,
    the skipped matmuls) is redone. The CPU attention kernel is kept too: it is this
    machine's flash attention."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten.max.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if op is aten.mm.default:
            counts[key] += 1
        second = op is aten.mm.default and counts[key] % 2 == 0 and not every_matmul
        keep = op in save and not second
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# the peer's checkpointing per recompute mode: (tetrad's mode, the peer's)
MODES = (("none", "none"), ("selective", "op"), ("selective", "op, every matmul"),
         ("full", "full"))  # fmt: skip
LOSS_CHUNKS = (0, 1024)  # tetrad's: full logits as the peer's (like for like), its default
ROWS = tuple((mode, peer, chunk) for chunk in LOSS_CHUNKS for mode, peer in MODES)


def checkpointed(peer: str):
    """torchtitan's activation checkpointing `peer` (of a MODES entry), applied to each block
    in place: "full" wraps every block in `checkpoint_wrapper`; "op" is its per-op
    selective policy (what its Llama 3 configurations use)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    def context():  # a fresh matmul count for every checkpointed call
        return create_selective_checkpoint_contexts(_op_sac_policy(peer != "op"))

    def wrap(model) -> None:
        for name, block in list(model.layers.items()):
            if peer == "full":
                model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
            elif peer.startswith("op"):
                model.layers[name] = checkpoint_wrapper(
                    block, context_fn=context, preserve_rng_state=False
                )

    return wrap


def worker(rank: int, world: int, raw: dict, steps: int, warmup: int, rounds: int) -> list:
    """Per row (recompute mode, tetrad's loss chunk): both sides measured through
    warm-up, then timed rounds."""
    out = []
    for row in ROWS:
        sides = None  # the last row's objects go before this row is measured (harness.start)
        cfg = configured(from_dict(raw), row)
        peer = row[1]
        makers = {
            "tetrad": lambda cfg=cfg: harness.tetrad_trainer(cfg, rank, fsdp=world),
            "fsdp2": lambda cfg=cfg, peer=peer: harness.side(
                harness.FSDP2Runner(cfg, rank, world, checkpointed(peer))
            ),
        }
        sides, result = harness.race(makers, warmup, steps, rounds)
        run = sides["tetrad"].engine.last_run
        out.append(result | {"tetrad_saved_bytes": run.peak_activation_bytes})
    return out


def configured(cfg: Config, row: tuple[str, str, int]) -> Config:
    """`cfg` with a ROWS entry's recompute mode and loss chunk."""
    cfg.train.recompute, _, cfg.train.loss_chunk = row
    return cfg


def predicted_saved(cfg: Config, rank: int) -> float:
    planner = Planner(cluster_preset("cpu"), TETRAD, cfg.train.recompute)
    pp_rank = Mesh.plan(cfg.parallel.degrees, rank).coord["pp"]
    return planner.rank_activations(Layout.build(cfg), cfg.model, pp_rank)


def summarize(cfg: Config, row: tuple[str, str, int], out: dict, steps: int) -> dict[str, Any]:
    cfg = configured(from_dict(cfg.to_dict()), row)
    t_loss = out["losses"]["tetrad"]
    return {
        "recompute": row[0],
        "fsdp2_checkpointing": row[1],
        "tetrad_loss_chunk": row[2],
        "like_for_like": row[2] == 0,  # both sides compute full logits
        **harness.timing(out["seconds"], cfg, steps),
        **harness.memory(out["peaks"]),
        "tetrad_saved_activation_bytes_measured": out["tetrad_saved_bytes"],
        "tetrad_saved_activation_bytes_predicted": int(predicted_saved(cfg, 0)),
        "losses_max_rel_diff": max(harness.rel_diffs(t_loss, out["losses"]["fsdp2"])),
    }


def main() -> None:
    args = harness.arguments(__doc__, "--worlds", steps=2, rounds=8, warmup=2).parse_args()
    model = asdict(model_preset("small")) | {"layers": 8}
    rows = []
    for world in args.worlds[:1] if args.worlds == [2, 4] else args.worlds:
        total = args.warmup + args.rounds * args.steps
        cfg = harness.job(model, {"fsdp": world, "zero_stage": 3}, total)
        per_mode = spawn(worker, world, cfg.to_dict(), args.steps, args.warmup, args.rounds,
                         timeout=1800)[0]  # fmt: skip
        rows += [{"fsdp": world} | summarize(cfg, r, o, args.steps) for r, o in zip(ROWS, per_mode)]
    harness.report("memory", cfg, rows, zero_stage=3, dtype="fp32", fsdp2_loss="full logits",
                   steps_per_round=args.steps, rounds=args.rounds, memory_measure="peak live "
                   "tensor bytes, c10 CPU allocator via torch.profiler")  # fmt: skip


if __name__ == "__main__":
    main()
