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


class MetricsWriter:
    """Appends one JSON object per step to DIR/metrics.jsonl and drives the progress display."""

    def __init__(self, out_dir: str, total_steps: int, progress: bool, append: bool = False):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a" if append else "w")  # noqa: SIM115
        self.total = total_steps
        self.display = Display(total_steps) if progress else None

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.display:
            self.display.update(row)

    def close(self) -> None:
        self.file.close()
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
        return (
            f"loss {row['loss']:.4f} | {row['tokens_per_s']:,.0f} tok/s | "
            f"MFU {100 * row['mfu']:.2f}% | mem {row['peak_mem_bytes'] / 2**20:,.0f} MiB{skipped}"
        )

    def update(self, row: dict[str, Any]) -> None:
        if self.live:
            self.bar.update(self.task, completed=row["step"] + 1, info=self.describe(row))
        elif row["step"] % self.every == 0 or row["step"] + 1 == self.total:
            print(f"step {row['step'] + 1}/{self.total} | {self.describe(row)}", flush=True)

    def close(self) -> None:
        if self.live:
            self.bar.stop()
