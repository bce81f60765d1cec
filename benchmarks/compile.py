"""`--compile` measured: tetrad's compiled blocks against its eager ones, against PyTorch's
peers compiled the way torchtitan compiles them, and tetrad's eager Llama against
transformers' `LlamaForCausalLM`.

Same model (tetrad's Llama, "small" preset: 4 layers, dim 128), same batches (16 x 128
tokens of the standard-library corpus), fp32, gloo, one thread per rank, inductor's C++
backend. Each side is built and warmed up (`--warmup` steps: the compilation happens
there, its seconds reported apart), then timed rounds alternate between the two sides
(harness.py: medians of the rounds' ratios, spreads).

- world 1 and 2 (dp, fsdp: ZeRO-3, tp + sp, pp 1f1b): tetrad `--compile` over tetrad eager;
- world 2: tetrad compiled against DDP and `fully_shard` (FSDP2) with each block compiled
  whole (`nn.Module.compile`, before sharding, as torchtitan's `apply_compile`);
- world 1: fwd + bwd of tetrad's eager Llama against transformers' at the same shape
  (rotary, RMSNorm, SwiGLU, SDPA attention), the same weights.

    .venv/bin/python benchmarks/compile.py            # prints JSON
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn

import harness
from dp import DDPRunner
from tetrad.config import Config, from_dict, model_preset
from tetrad.layout import Layout
from tetrad.mesh import Mesh
from tetrad.testing import spawn
from tetrad.train.loop import Trainer

CPU = torch.device("cpu")

LAYOUTS = {  # name -> (world, parallel degrees)
    "single": (1, {}),
    "dp": (2, {"dp": 2}),
    "fsdp": (2, {"fsdp": 2, "zero_stage": 3}),
    "tp": (2, {"tp": 2, "sp": True}),
    "pp": (2, {"pp": 2, "microbatches": 4, "pp_schedule": "1f1b"}),
}


def _config(cfg: Config, par: dict, compiled: bool) -> Config:
    raw = cfg.to_dict()
    return from_dict(raw | {"parallel": par, "train": raw["train"] | {"compile": compiled}})


def _compiled_whole(model: nn.Module) -> None:
    for block in model.layers.values():
        nn.Module.compile(block)  # the whole call, hooks included: torchtitan's way


def worker(rank: int, world: int, raw: dict, par: dict, peer: str, args: tuple) -> dict:
    """tetrad compiled against tetrad eager (peer "eager") or a compiled PyTorch peer."""
    warmup, steps, rounds = args
    if not dist.is_initialized():  # world 1: spawn makes no group, the timing's reductions need one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = from_dict(raw)
    makers = {"tetrad": lambda: _tetrad(_config(cfg, par, True), rank)}
    if peer == "eager":
        makers["eager"] = lambda: _tetrad(_config(cfg, par, False), rank)
    elif peer == "ddp_compiled":
        makers[peer] = lambda: harness.side(_ddp_compiled(cfg, rank, world))
    else:
        makers[peer] = lambda: harness.side(
            harness.FSDP2Runner(cfg, rank, world, wrap=_compiled_whole)
        )
    sides, out = harness.race(makers, warmup, steps, rounds)
    return out | {"tetrad_compile_s": sides["tetrad"].compile_cost.read()[0]}


def _tetrad(cfg: Config, rank: int) -> tuple[Trainer, harness.Step]:
    trainer = Trainer(cfg, Mesh.build(Layout.build(cfg, cfg.parallel.world), rank), CPU)
    return trainer, lambda: trainer.train_step().loss


def _ddp_compiled(cfg: Config, rank: int, world: int) -> DDPRunner:
    runner = DDPRunner(cfg, rank, world)
    _compiled_whole(runner.ddp.module)
    return runner


def eager_against_transformers(cfg: Config, rounds: int) -> dict:
    """fwd + bwd (the summed token loss) of tetrad's eager Llama and transformers' on the
    same weights and tokens, alternating rounds; the medians and their ratios, by wall time
    and by this thread's CPU time (what the other jobs of a shared machine disturb least)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    ours = harness.peer_model(cfg)
    hf_cfg = LlamaConfig(
        vocab_size=m.vocab, hidden_size=m.dim, intermediate_size=m.hidden_dim,
        num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings,
        attn_implementation="sdpa",
    )  # fmt: skip
    theirs = LlamaForCausalLM(hf_cfg)
    tokens = harness.peer_loader(cfg).next()[0]
    x, y = tokens.inputs, tokens.targets

    def timed(step: Callable[[], torch.Tensor]) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:  # (wall, this thread's CPU) seconds
            t0, c0 = time.perf_counter(), time.thread_time()
            step().backward()
            return time.perf_counter() - t0, time.thread_time() - c0

        return run

    sides = {
        "tetrad": timed(lambda: harness.cross_entropy_sum(ours(x), y)),
        "transformers": timed(lambda: harness.cross_entropy_sum(theirs(input_ids=x).logits, y)),
    }
    for run in sides.values():  # warm-up
        run()
    times = harness.alternate(sides, rounds)
    wall = {k: [w for w, _ in v] for k, v in times.items()}
    cpu = {k: [c for _, c in v] for k, v in times.items()}
    return {
        "tetrad_eager_fwd_bwd_s": round(statistics.median(wall["tetrad"]), 4),
        "transformers_fwd_bwd_s": round(statistics.median(wall["transformers"]), 4),
        **harness.ratio_fields("speed_tetrad_over_transformers", _ratios(wall)),
        **harness.ratio_fields("cpu_speed_tetrad_over_transformers", _ratios(cpu), "cpu_ratio"),
    }


def _ratios(seconds: dict[str, list[float]]) -> list[float]:
    """Each round's speed of tetrad over transformers: their seconds over tetrad's."""
    return [b / a for a, b in zip(seconds["tetrad"], seconds["transformers"])]


def main() -> None:
    p = harness.arguments(__doc__, "--worlds", steps=2, rounds=10, warmup=2)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = p.parse_args()
    total = args.warmup * 2 + args.rounds * args.steps
    cfg = harness.job(asdict(model_preset("small")), {}, total)
    runs = [(name, "eager") for name in args.layouts if LAYOUTS[name][0] in args.worlds]
    if 2 in args.worlds:
        runs += [("dp", "ddp_compiled"), ("fsdp", "fsdp2_compiled")]
    rows = []
    for name, peer in runs:
        world, par = LAYOUTS[name]
        timing = (args.warmup, args.steps, args.rounds)
        out = spawn(worker, world, cfg.to_dict(), par, peer, timing, timeout=3000)[0]
        rows.append({"layout": name, "world": world, "against": peer,
                     **harness.timing(out["seconds"], cfg, args.steps),
                     "tetrad_compile_s": round(out["tetrad_compile_s"], 1)})  # fmt: skip
    torch.set_num_threads(1)
    transformers = eager_against_transformers(cfg, args.rounds) if 1 in args.worlds else {}
    harness.report("compile", cfg, rows, eager_against_transformers=transformers,
                   steps_per_round=args.steps, rounds=args.rounds, warmup=args.warmup)  # fmt: skip


if __name__ == "__main__":
    main()
