"""tetrad's GPU path, checked in one run on the GPUs of this machine; one JSON summary.

    scripts/gpu_check.sh [--out gpu_check.json] [--gpus N] [--steps 50] [--skip-tests]

1. the test suite's CUDA-marked tests (pytest -m cuda);
2. single-GPU bf16 training of a 125M-parameter Llama (12 layers, dim 768, vocab 32000)
   for `--steps` steps: tokens/s and MFU (medians past the first steps), against the
   declared peak of the GPU;
3. that run's measured peak memory (the caching allocator's) against `tetrad plan`'s
   prediction for the same model, batch and device;
4. with 2 or more GPUs: dp, fsdp (ZeRO-3), tp (+SP), pp 1f1b and pp zb-h1 over 2 GPUs for
   a few fp32 steps each, every loss against the single-GPU run's (relative `--rtol`),
   each run under a timeout, so a hang is reported, not waited for;
5. with 2 or more GPUs: `tetrad bench comm` over the GPUs.

Every part is a subprocess with its own timeout; a part that fails or times out is
recorded and the next one runs. The summary's "ok" is true only if every part that ran
passed; parts that could not run here (one GPU) are listed under "skipped" with why.
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
}


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
    return args


def plan_parts(args: argparse.Namespace, gpus: int, work: Path) -> tuple[list[Part], list[str]]:
    """The parts to run on `gpus` GPUs, and the ones skipped with the reason."""
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
            ],
            240,
        )
    )
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
            120,
        )
    )
    for name, flags in LAYOUTS.items():
        mb = [] if "--microbatches" in flags else ["--microbatches", "4"]
        parts.append(
            Part(
                f"layout_{name}",
                [*train, *layout, *flags, *mb, "--nproc", "2", "--out", str(work / name)],
                120,
            )
        )
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


def summarize(env: dict[str, Any], parts: list[Part], skipped: list[str], seconds: float) -> dict:
    """The one JSON object: ok only if every part that ran passed."""
    results = {p.name: p.result for p in parts}
    return {
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


def evaluate(part: Part, work: Path, args: argparse.Namespace, gpu: str) -> None:
    """Read what a finished part wrote, and judge it."""
    r = part.result
    if part.name == "cuda_tests" and (work / "cuda_tests.xml").exists():
        r["tests"] = junit_counts(work / "cuda_tests.xml")
    elif part.name == "train_bf16_100m" and r["ok"]:
        r |= throughput(read_metrics(work / "bf16"))
        r["ok"] = r.get("finite", False) and r.get("steps") == args.steps
        r["memory"] = planned_memory(args, gpu, r.get("peak_mem_bytes"))
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
    if kind is None:
        return {"error": f"no planner preset for {gpu!r}"}
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
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        parts, skipped = plan_parts(args, gpus, work)
        for part in parts:
            print(f"gpu_check: {part.name} ...", file=sys.stderr, flush=True)
            run_part(part)
            evaluate(part, work, args, env["gpus"][0])
            print(
                f"gpu_check: {part.name}: {'ok' if part.result['ok'] else 'FAILED'}",
                file=sys.stderr,
                flush=True,
            )
        summary = summarize(env, parts, skipped, time.time() - t0)
    write_summary(Path(args.out), summary)
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
