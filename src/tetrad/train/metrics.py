"""Per-step metrics: `metrics.jsonl` (rank 0) and a live progress display."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the caching allocator's peak. CPU: the process's peak resident set (ru_maxrss)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class CompileCost:
    """What torch.compile (`--compile`) cost since the last `read`: seconds compiling (the
    frames dynamo compiles, and the backward graphs compiled at their first backward) and
    recompilations (dynamo's guard failures: a recompiled block after the first step is a
    guard on something that changes from step to step, or from microbatch to microbatch)."""

    TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")

    def __init__(self) -> None:
        self.last = self._totals()

    @classmethod
    def _totals(cls) -> tuple[float, int]:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries
        from torch._dynamo.utils import compilation_time_metrics, guard_failures

        seconds = sum(sum(compilation_time_metrics.get(key, ())) for key in cls.TIMERS)
        # a code whose guards failed holds one compiled entry more for each recompilation
        return seconds, sum(len(entries(code)) - 1 for code in guard_failures)

    def read(self) -> tuple[float, int]:
        last, self.last = self.last, self._totals()
        return self.last[0] - last[0], self.last[1] - last[1]  # seconds, recompilations


# metrics.jsonl keys that TensorBoard shows, under these tags
SCALARS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "epoch": "train/epoch",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "peak_mem_bytes": "memory/peak_bytes",
    "model_state_bytes": "memory/model_state_bytes",
    "comm_bytes": "comm/bytes",
    "compile_s": "perf/compile_s",
}


def require_tensorboard() -> None:
    """--tensorboard needs the optional package; every rank checks before training."""
    try:
        import tensorboard  # noqa: F401
    except ImportError as e:
        raise ValueError(
            "--tensorboard needs the tensorboard package: pip install 'tetrad[tensorboard]'"
        ) from e


class MetricsWriter:
    """Appends one JSON object per step to DIR/metrics.jsonl and drives the progress display;
    with `tensorboard`, the same series as event files under DIR/tensorboard. `resumed`: the
    step a resumed run starts at (its rows are appended), None on a fresh start."""

    def __init__(
        self,
        out_dir: str,
        total_steps: int,
        progress: bool,
        tensorboard: bool = False,
        resumed: int | None = None,
    ):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w" if resumed is None else "a")  # noqa: SIM115
        self.display = Display(total_steps) if progress else None
        self.events = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run purges the events of steps it is about to redo
            self.events = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=resumed)

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.events is not None:
            for key, tag in SCALARS.items():
                if key in row:
                    self.events.add_scalar(tag, row[key], row["step"])
        if self.display:
            self.display.update(row)

    def close(self) -> None:
        self.file.close()
        if self.events is not None:
            self.events.close()
        if self.display:
            self.display.close()


class Display:
    """A rich progress bar on a terminal; plain log lines (about 20 per run) otherwise."""

    def __init__(self, total: int):
        self.total = total
        self.every = max(1, total // 20)
        self.live = sys.stdout.isatty()
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self.task = self.bar.add_task("train", total=total, info="")
            self.bar.start()

    @staticmethod
    def describe(row: dict[str, Any]) -> str:
        skipped = " SKIPPED" if row["skipped"] else ""
        held = f" (eval {row['eval_loss']:.4f})" if "eval_loss" in row else ""
        return (
            f"loss {row['loss']:.4f}{held} | {row['tokens_per_s']:,.0f} tok/s | "
            f"MFU {100 * row['mfu']:.2f}% | mem {row['peak_mem_bytes'] / 2**20:,.0f} MiB{skipped}"
        )

    def update(self, row: dict[str, Any]) -> None:
        if self.live:
            self.bar.update(self.task, completed=row["step"] + 1, info=self.describe(row))
        elif row["step"] % self.every == 0 or row["step"] + 1 == self.total or "eval_loss" in row:
            print(f"step {row['step'] + 1}/{self.total} | {self.describe(row)}", flush=True)

    def close(self) -> None:
        if self.live:
            self.bar.stop()
