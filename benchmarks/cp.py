"""Context parallelism at sequence 4096: activation memory per rank and tokens/s at cp 1, 2, 4.

Run: .venv/bin/python benchmarks/cp.py [--cp 1 2 4] [--steps 2] [--rounds 3]

The peer is PyTorch's `context_parallel` (torch.distributed.tensor.experimental). It is
probed first, on the same kind of causal attention: on a CPU build of torch it does not
run (its ring dispatches only the CUDA attention kernels), and the report carries the
error it raises. tetrad is then measured against its own cp 1 and against the memory
formula of docs/cp.md: every saved activation of this model is per token, so a rank
holding S/cp tokens saves M(1)/cp, plus what the cp core keeps beyond that (the
all-gather core: the whole sequence's keys and values, unrepeated; the ring: only its
own, unrepeated; both an fp32 output).

Each cp degree runs in its own set of processes (a different world size), so the rounds
alternate within a degree only; tokens/s are medians over rounds with their spread, and
cp 4 oversubscribes this machine's cores (it measures overhead under contention).
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import arguments, report, spread, start, tetrad_trainer, timed_block
from tetrad.config import DTYPE_BYTES, Config, from_dict
from tetrad.launch import free_port
from tetrad.layout import Layout
from tetrad.testing import spawn

SEQ = 4096
MODEL = {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "max_seq_len": SEQ}


def job(cp: int, attention: str, steps: int) -> Config:
    """One sequence of 4096 tokens per step, fp32, the embedded corpus."""
    train = {"steps": steps, "global_batch": 1, "seq_len": SEQ, "progress": False}
    parallel = {"cp": cp, "cp_attention": attention}
    return from_dict({"model": MODEL, "train": train, "parallel": parallel})


def core_extra_bytes(cfg: Config) -> float:
    """What one rank's cp attention cores save beyond 1/cp of the single process (all
    layers, one microbatch of b sequences): docs/cp.md's formula. Both keep their keys and
    values unrepeated (the whole sequence's, all-gathered; or their own, ring) where the
    single process's kernel keeps them repeated to the query heads, and an fp32 output."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.cp == 1:
        return 0.0
    b, seq, c = Layout.build(cfg).microbatch_size, t.seq_len, DTYPE_BYTES[t.dtype]
    local = seq // p.cp
    keys = seq if p.cp_attention == "allgather" else local
    kv = 2 * b * m.head_dim * c * (keys * m.kv_heads - local * m.heads)
    # the fp32 output: in fp32 the very tensor the next matmul keeps, else a copy beside it
    out = 0 if c == 4 else 4 * b * local * m.heads * m.head_dim
    return m.layers * (kv + out)


def worker(rank: int, world: int, raw: dict, steps: int, rounds: int) -> dict:
    """This cp degree's measurements: the saved-activation peak (max over ranks), the
    profiler's peak of live tensors in a step, tokens/s per round, cp bytes per step."""
    torch.manual_seed(0)
    if not dist.is_initialized():  # cp 1: a group of one, for the harness's instruments
        port = free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cfg = from_dict(raw)
    box: dict = {}

    def make():
        box["trainer"], step = tetrad_trainer(cfg, rank, cp=world)
        return box["trainer"], step

    losses: list[float] = []
    trainer, step, peaks = start(make, 1, losses)
    saved = torch.tensor([float(trainer.engine.last_run.peak_activation_bytes)])
    dist.all_reduce(saved, op=dist.ReduceOp.MAX)
    tokens = cfg.train.global_batch * cfg.train.seq_len * steps
    seconds = [timed_block(step, steps, losses) for _ in range(rounds)]
    cp_comm = {k: v for k, v in trainer.comm.summary().items() if k.startswith("cp/")}
    return {
        "cp": world,
        "peak_activation_bytes": int(saved),
        "peak_step_tensor_bytes": peaks["step"],
        "tokens_per_s_rounds": [round(tokens / wall, 1) for wall, _ in seconds],
        "cpu_s_per_step_rounds": [round(cpu / steps, 3) for _, cpu in seconds],
        "losses": losses,
        "cp_comm_per_step": {
            k: {"calls": v["calls"], "bytes": v["bytes"]} for k, v in cp_comm.items()
        },
    }


def peer_probe(rank: int, world: int) -> dict:
    """Run PyTorch's context_parallel on causal SDPA (forward and backward), with the
    default CPU kernel and with the math kernel; the error each raises, if any."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, kernel in (("default", nullcontext), ("math", partial(sdpa_kernel, SDPBackend.MATH))):
        q, k, v = (torch.randn(1, MODEL["heads"], 256, 16) for _ in range(3))
        try:
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                with kernel():
                    F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()
            out[name] = "runs"
        except Exception as e:  # what the peer raises is the finding
            out[name] = f"{type(e).__name__}: {e}"[:300]
    return out


def summarise(row: dict, base: dict | None, cfg: Config) -> dict:
    """Medians and spreads; memory against the formula; ratios to cp 1."""
    tps = statistics.median(row["tokens_per_s_rounds"])
    out = {k: row[k] for k in ("cp", "peak_activation_bytes", "peak_step_tensor_bytes")}
    out |= {
        "tokens_per_s": round(tps, 1),
        "tokens_per_s_spread": spread(row["tokens_per_s_rounds"]),
    }
    out |= {k: row[k] for k in ("cpu_s_per_step_rounds", "cp_comm_per_step")}
    if base is not None:
        predicted = base["peak_activation_bytes"] / cfg.parallel.cp + core_extra_bytes(cfg)
        out["predicted_activation_bytes"] = int(predicted)
        out["measured_over_predicted"] = round(row["peak_activation_bytes"] / predicted, 4)
        out["activation_ratio_to_cp1"] = round(
            row["peak_activation_bytes"] / base["peak_activation_bytes"], 4
        )
        out["tokens_per_s_ratio_to_cp1"] = round(
            tps / statistics.median(base["tokens_per_s_rounds"]), 3
        )
        same = [abs(a - b) / abs(b) for a, b in zip(row["losses"], base["losses"])]
        out["max_rel_loss_diff_to_cp1"] = float(f"{max(same):.2e}")
    return out


def main() -> None:
    p = arguments(__doc__, "--cp", steps=2, rounds=3)
    p.add_argument("--attention", default="allgather", choices=("allgather", "ring"))
    args = p.parse_args()
    peer = spawn(peer_probe, 2, timeout=300)[0]
    rows, base = [], None
    degrees = sorted(set(args.cp) | {1})
    for cp in degrees:
        cfg = job(cp, args.attention, args.steps * (args.rounds + 1))
        raw = cfg.to_dict()
        row = spawn(worker, cp, raw, args.steps, args.rounds, timeout=1800)[0]
        base = base or row
        rows.append(summarise(row, None if cp == 1 else base, cfg))
    cfg = job(1, args.attention, args.steps)
    report("cp", cfg, rows, attention=args.attention, torch_context_parallel_on_cpu=peer)


if __name__ == "__main__":
    main()
