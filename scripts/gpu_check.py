"""tetrad's GPU path, checked in one run on the GPUs of this machine; one JSON summary.

    scripts/gpu_check.sh [--out gpu_check.json] [--gpus N] [--steps 50] [--skip-tests]

1. the test suite's CUDA-marked tests (pytest -m cuda);
2. single-GPU bf16 training of a 125M-parameter Llama (12 layers, dim 768, vocab 32000)
   for `--steps` steps: tokens/s and MFU (medians past the first steps), against the
   declared peak of the GPU, or, for a GPU tetrad has no figure for, a bf16 matmul peak
   measured here (reported as such); it fails under `--mfu-floor`; then the same run
   with `--compile`: its MFU, tokens/s over the eager run's, the seconds compiling and
   the recompilations after the first step (it fails on any, or on a non-finite loss);
   and the same run with `--fp8 tensorwise`: its MFU (against the bf16 peak, as the bf16
   run's) and tokens/s over the bf16 run's (it fails on a non-finite loss); then one MoE
   layer's experts in bf16 (scripts/gpu_check_moe.py): the path tetrad takes (torch's
   grouped matmul on sm90, else the loop and why) against the loop over experts, forward
   and backward, their max differences and times (it fails outside its fp64 bound, on an
   empty expert's nonzero gradient, or on a loop on sm90);
3. that run's measured peak memory (the caching allocator's) against `tetrad plan`'s
   prediction for the same model, batch and device: it fails when they differ by more
   than `--memory-tol` (relative);
4. with 2 or more GPUs: dp, fsdp (ZeRO-3), tp (+SP), pp 1f1b, zb-h1 and interleaved 1F1B,
   and cp (ring attention) over 2 GPUs for a few fp32 steps each, every loss against the
   single-GPU run's (relative `--rtol`), each run under a timeout, so a hang is reported,
   not waited for;
5. with 2 or more GPUs: `tetrad bench comm` over the GPUs.

Every part is a subprocess with its own timeout; a part that fails or times out is
recorded and the next one runs. The summary's "ok" is true only if every part that ran
passed; parts that could not run here (one GPU) are listed under "skipped" with why. The
thresholds judged against are in the summary (`thresholds`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL_100M = [
    "--model",
    "base",
    "--layers",
    "12",
    "--dim",
    "768",
    "--heads",
    "12",
    "--kv-heads",
    "4",
    "--vocab",
    "32000",
]
LAYOUT_MODEL = ["--model", "base"]  # 8 layers, dim 256: the layouts' equivalence runs
LAYOUTS: dict[str, list[str]] = {
    "dp": ["--dp", "2"],
    "fsdp": ["--fsdp", "2"],
    "tp": ["--tp", "2", "--sp"],
    "pp-1f1b": ["--pp", "2", "--pp-schedule", "1f1b", "--microbatches", "4"],
    "pp-zb-h1": ["--pp", "2", "--pp-schedule", "zb-h1", "--microbatches", "4"],
    "pp-interleaved": [
        "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--microbatches", "4",
        "--virtual-stages", "2",
    ],
    "cp-ring": ["--cp", "2", "--cp-attention", "ring"],
}  # fmt: skip
# What the 125M bf16 step must reach. MFU: a floor that a working GPU path clears with
# room (the step is small, 8k tokens, so kernel launches weigh: 10%, not a target) and
# that an fp32 fallback, a per-step device drain or an unfused attention would not.
MFU_FLOOR = 0.10
MEMORY_TOL = 0.10  # |measured / predicted - 1| of the peak memory


@dataclass
class Part:
    """One part of the check: its name, the command, how long it may take."""

    name: str
    argv: list[str]
    timeout_s: float
    result: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, validated: a ValueError names the bad values."""
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_check.json", help="the JSON summary's path")
    p.add_argument("--workdir", help="run directories (default: a temporary directory)")
    p.add_argument("--gpus", type=int, help="GPUs to use (default: every visible one)")
    p.add_argument("--steps", type=int, default=50, help="steps of the bf16 ~100M run")
    p.add_argument("--layout-steps", type=int, default=8, help="steps of each layout run")
    p.add_argument("--rtol", type=float, default=1e-4, help="layouts' loss tolerance")
    p.add_argument("--skip-tests", action="store_true", help="skip the CUDA-marked tests")
    p.add_argument("--mfu-floor", type=float, default=MFU_FLOOR, help="the bf16 run's least MFU")
    p.add_argument(
        "--memory-tol", type=float, default=MEMORY_TOL, help="peak memory vs the plan, relative"
    )
    args = p.parse_args(argv)
    if args.steps < 12 or args.layout_steps < 1:
        raise ValueError(
            f"need --steps >= 12 (10 warm-up steps are left out of the medians) and "
            f"--layout-steps >= 1, got --steps {args.steps}, --layout-steps {args.layout_steps}"
        )
    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    if not args.rtol > 0:
        raise ValueError(f"--rtol must be > 0, got {args.rtol}")
    if not 0 <= args.mfu_floor < 1 or not args.memory_tol > 0:
        raise ValueError(
            f"need 0 <= --mfu-floor < 1 and --memory-tol > 0, got --mfu-floor "
            f"{args.mfu_floor}, --memory-tol {args.memory_tol}"
        )
    return args


def thresholds(args: argparse.Namespace) -> dict[str, float]:
    """What the parts are judged against (written into the summary)."""
    return {"mfu_floor": args.mfu_floor, "memory_tol": args.memory_tol, "loss_rtol": args.rtol}


def plan_parts(
    args: argparse.Namespace, gpus: int, work: Path, peak: float | None = None
) -> tuple[list[Part], list[str]]:
    """The parts to run on `gpus` GPUs, and the ones skipped with the reason. `peak`: the
    bf16 TFLOP/s to give the 125M run (a GPU without a declared one: measured here)."""
    py, train = sys.executable, [sys.executable, "-m", "tetrad.cli", "train"]
    common = ["--device", "cuda", "--data", "synthetic", "--no-progress"]
    parts, skipped = [], []
    if not args.skip_tests:
        xml = str(work / "cuda_tests.xml")
        parts.append(
            Part(
                "cuda_tests",
                [py, "-m", "pytest", "-q", "-m", "cuda", "tests", f"--junitxml={xml}"],
                240,
            )
        )
    else:
        skipped.append("cuda_tests: --skip-tests")
    parts.append(
        Part(
            "train_bf16_100m",
            [
                *train,
                *common,
                *MODEL_100M,
                "--nproc",
                "1",
                "--dtype",
                "bf16",
                "--global-batch",
                "8",
                "--seq-len",
                "1024",
                "--steps",
                str(args.steps),
                "--out",
                str(work / "bf16"),
                *(["--peak-tflops", f"{peak:.1f}"] if peak else []),
            ],
            240,
        )
    )
    eager = parts[-1]
    compiled = [*eager.argv[: eager.argv.index("--out")], "--compile"]
    parts.append(
        Part("train_bf16_100m_compiled", [*compiled, "--out", str(work / "compiled")], 300)
    )
    fp8 = [*compiled[:-1], "--fp8", "tensorwise", "--out", str(work / "fp8")]
    parts.append(Part("train_bf16_100m_fp8", fp8, 240))
    moe = [py, str(ROOT / "scripts/gpu_check_moe.py"), "--json", str(work / "moe.json")]
    parts.append(Part("moe_grouped_mm", moe, 60))
    layout = [
        *common,
        *LAYOUT_MODEL,
        "--dtype",
        "fp32",
        "--global-batch",
        "8",
        "--seq-len",
        "256",
        "--steps",
        str(args.layout_steps),
    ]
    if gpus < 2:
        skipped.append(f"layouts and bench comm: need 2 GPUs, this machine has {gpus}")
        return parts, skipped
    parts.append(
        Part(
            "layout_single",
            [*train, *layout, "--nproc", "1", "--microbatches", "4", "--out", str(work / "single")],
            90,
        )
    )
    for name, flags in LAYOUTS.items():
        mb = [] if "--microbatches" in flags else ["--microbatches", "4"]
        parts.append(
            Part(
                f"layout_{name}",
                [*train, *layout, *flags, *mb, "--nproc", "2", "--out", str(work / name)],
                90,
            )
        )
    skipped.append("ep all-to-all: expert parallelism has not landed in this version")
    parts.append(
        Part(
            "bench_comm",
            [
                py,
                "-m",
                "tetrad.cli",
                "bench",
                "comm",
                "--nproc",
                str(gpus),
                "--max-bytes",
                str(256 * 2**20),
                "--json",
                str(work / "bench.json"),
            ],
            180,
        )
    )
    return parts, skipped


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (empty when the run wrote none)."""
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def throughput(rows: list[dict[str, Any]], warmup: int = 10) -> dict[str, Any]:
    """Medians of tokens/s, MFU and step time past the warm-up steps; the peak memory."""
    steady = rows[warmup:]
    if not steady:
        return {"steps": len(rows), "error": f"fewer than {warmup + 1} steps recorded"}
    return {
        "steps": len(rows),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows),
        "final_loss": rows[-1]["loss"],
        "finite": all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in rows),
    }


def compare_losses(ref: list[float], got: list[float], rtol: float) -> dict[str, Any]:
    """Per-step relative loss differences against the reference run."""
    if not ref or len(ref) != len(got):
        return {"ok": False, "error": f"{len(got)} steps against {len(ref)} reference steps"}
    diffs = [abs(g - r) / max(abs(r), 1e-12) for r, g in zip(ref, got)]
    return {"ok": max(diffs) <= rtol, "max_rel_diff": max(diffs), "rtol": rtol, "steps": len(ref)}


def junit_counts(path: Path) -> dict[str, int]:
    """passed/failed/skipped/errors from a pytest --junitxml file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return n


def judge_bf16(r: dict[str, Any], steps: int, limits: dict[str, float]) -> dict[str, Any]:
    """The 125M run's verdict: finite losses, every step, MFU at least the floor, peak
    memory within the tolerance of the plan's. `failed` names each check missed."""
    failed = []
    if not r.get("finite"):
        failed.append("a loss is not finite")
    if r.get("steps") != steps:
        failed.append(f"{r.get('steps')} steps recorded, {steps} asked")
    mfu = r.get("mfu")
    if mfu is None or mfu < limits["mfu_floor"]:
        failed.append(f"MFU {mfu} under the floor {limits['mfu_floor']}")
    ratio = r.get("memory", {}).get("measured_over_predicted")
    if ratio is None:
        failed.append(f"peak memory not compared with the plan: {r.get('memory')}")
    elif abs(ratio - 1) > limits["memory_tol"]:
        failed.append(f"peak memory {ratio:.3f}x the plan's, beyond +-{limits['memory_tol']:.0%}")
    return {"ok": not failed, "failed": failed}


def judge_variant(run: dict[str, Any], base: dict[str, Any], name: str) -> dict[str, Any]:
    """A variant of the 125M bf16 run (`name`: "eager" for --compile, "bf16" for --fp8)
    against it: both MFUs (against the same peak) and the ratio of their tokens/s;
    failed on a non-finite loss."""
    out = run | {f"{name}_mfu": base.get("mfu")}
    if "tokens_per_s" in run and "tokens_per_s" in base:
        out[f"speedup_over_{name}"] = run["tokens_per_s"] / base["tokens_per_s"]
    failed = [] if run.get("finite") else ["a loss is not finite, or too few steps"]
    return out | {"ok": not failed, "failed": failed}


def judge_compiled(
    compiled: dict[str, Any], rows: list[dict[str, Any]], eager: dict[str, Any]
) -> dict[str, Any]:
    """The compiled 125M run against the eager one (`judge_variant`), its compile seconds;
    also failed on a recompilation after step 0."""
    later = sum(row.get("recompiles", 0) for row in rows[1:])
    out = judge_variant(compiled, eager, "eager") | {
        "compile_s": round(sum(row.get("compile_s", 0.0) for row in rows), 1),
        "recompiles_after_first_step": later,
    }
    out["failed"] += [f"{later} recompilations after the first step"] if later else []
    return out | {"ok": not out["failed"]}


def summarize(
    env: dict[str, Any],
    parts: list[Part],
    skipped: list[str],
    seconds: float,
    limits: dict[str, float] | None = None,
) -> dict:
    """The one JSON object: ok only if every part that ran passed."""
    results = {p.name: p.result for p in parts}
    return {
        "thresholds": limits or {},
        "ok": bool(parts) and all(p.result.get("ok") for p in parts),
        "environment": env,
        "results": results,
        "skipped": skipped,
        "seconds": round(seconds, 1),
    }


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a file), pretty-printed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# --- running (needs the GPUs) --------------------------------------------------------------


def environment() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def device_peak() -> tuple[float, str]:
    """GPU 0's dense bf16 peak in TFLOP/s and where it comes from: tetrad's declared table,
    or, for a GPU not in it, the best of timed large bf16 matmuls here ("measured matmul":
    an MFU against it reads higher than against a datasheet figure)."""
    import torch

    from tetrad.devices import peak_tflops

    try:
        return peak_tflops(torch.device("cuda", 0), "bf16"), "declared"
    except ValueError:
        return matmul_tflops(), "measured matmul"


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    """Best of 3 timings of `reps` bf16 n x n matmuls, timed with CUDA events."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    best = float("inf")
    for i in range(4):  # the first: warm-up (kernel choice, clocks), not counted
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        end.synchronize()
        if i:
            best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return 2 * n**3 / best / 1e12


def run_part(part: Part) -> None:
    t0 = time.time()
    try:
        proc = subprocess.run(
            part.argv, cwd=ROOT, capture_output=True, text=True, timeout=part.timeout_s
        )
        part.result = {"ok": proc.returncode == 0, "returncode": proc.returncode}
        if proc.returncode != 0:
            part.result["stderr_tail"] = proc.stderr[-2000:]
    except subprocess.TimeoutExpired:
        part.result = {"ok": False, "error": f"timed out after {part.timeout_s:.0f} s (a hang?)"}
    part.result["seconds"] = round(time.time() - t0, 1)


def bf16_run(work: Path) -> dict[str, Any]:
    return throughput(read_metrics(work / "bf16"))


def evaluate(part: Part, work: Path, args: argparse.Namespace, gpu: str) -> None:
    """Read what a finished part wrote, and judge it."""
    r = part.result
    if part.name == "cuda_tests" and (work / "cuda_tests.xml").exists():
        r["tests"] = junit_counts(work / "cuda_tests.xml")
    elif part.name == "train_bf16_100m" and r["ok"]:
        r |= throughput(read_metrics(work / "bf16"))
        r["memory"] = planned_memory(args, gpu, r.get("peak_mem_bytes"))
        r |= judge_bf16(r, args.steps, thresholds(args))
    elif part.name == "train_bf16_100m_compiled" and r["ok"]:
        rows = read_metrics(work / "compiled")
        r |= judge_compiled(throughput(rows), rows, bf16_run(work))
    elif part.name == "train_bf16_100m_fp8" and r["ok"]:
        r |= judge_variant(throughput(read_metrics(work / "fp8")), bf16_run(work), "bf16")
    elif part.name == "moe_grouped_mm" and (work / "moe.json").exists():
        r |= json.loads((work / "moe.json").read_text()) | {"ok": r["ok"]}  # ok: exit status 0
    elif part.name.startswith("layout_") and part.name != "layout_single" and r["ok"]:
        ref = [row["loss"] for row in read_metrics(work / "single")]
        got = [row["loss"] for row in read_metrics(work / part.name.removeprefix("layout_"))]
        r |= compare_losses(ref, got, args.rtol)
    elif part.name == "bench_comm" and r["ok"]:
        report = json.loads((work / "bench.json").read_text())
        r["backend"] = report["backend"]
        r["peak_busbw_GBps"] = {
            op: max(x["busbw_GBps"] for x in report["results"] if x["op"] == op)
            for op in report["alpha_beta"]
        }


def planned_memory(args: argparse.Namespace, gpu: str, measured: int | None) -> dict[str, Any]:
    """`tetrad plan`'s memory per device for the bf16 run, next to the measured peak."""
    from tetrad.plan.hardware import CLUSTERS

    kind = next((k for k in sorted(CLUSTERS, key=len, reverse=True) if k in gpu.lower()), None)
    note = None
    if kind is None:  # the planner's bytes do not depend on the GPU kind, only its speed does
        kind = "h100" if "h100" in CLUSTERS else sorted(CLUSTERS)[0]
        note = f"no planner preset for {gpu!r}: {kind}'s used (memory is the same for all)"
    argv = [
        sys.executable,
        "-m",
        "tetrad.cli",
        "plan",
        *MODEL_100M,
        "--gpus",
        "1",
        "--gpu",
        kind,
        "--global-batch",
        "8",
        "--seq-len",
        "1024",
        "--dtype",
        "bf16",
        "--json",
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1000:]}
    pred = json.loads(proc.stdout)
    pred = pred["predictions"][0] if "predictions" in pred else pred
    total = pred["memory"]["total"]
    out = {"preset": kind, "predicted_bytes": total, "measured_bytes": measured}
    if note:
        out["note"] = note
    if measured:
        out["measured_over_predicted"] = measured / total
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: error: no CUDA device is visible; this check needs a GPU", file=sys.stderr
        )
        return 2
    gpus = min(args.gpus or torch.cuda.device_count(), torch.cuda.device_count())
    env = environment()
    env["peak_bf16_tflops"], env["peak_source"] = device_peak()
    measured = env["peak_source"] != "declared"
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        peak = env["peak_bf16_tflops"] if measured else None
        parts, skipped = plan_parts(args, gpus, work, peak)
        for part in parts:
            print(f"gpu_check: {part.name} ...", file=sys.stderr, flush=True)
            run_part(part)
            evaluate(part, work, args, env["gpus"][0])
            print(
                f"gpu_check: {part.name}: {'ok' if part.result['ok'] else 'FAILED'}",
                file=sys.stderr,
                flush=True,
            )
        summary = summarize(env, parts, skipped, time.time() - t0, thresholds(args))
    write_summary(Path(args.out), summary)
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
