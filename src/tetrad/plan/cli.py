"""`tetrad plan`: predict one layout, or search the layouts, of a model on a cluster.

    tetrad plan --model llama3-8b --gpus 64 --gpu h100 --global-batch 1024 --seq-len 8192 \\
        --fsdp 8 --tp 8                       # predict this layout (dp fills the rest)
    tetrad plan --model llama3-70b --gpus 256 --gpu h100 --search --top 5 --json
    tetrad plan --from-run runs/dp2 --from-run runs/fsdp2 --pp 2 --microbatches 4
                                              # fitted to this machine's runs

A layout is the degrees (dp, fsdp, tp, pp, cp; the ones not given: dp takes what is
left, the others are 1; ep, for a mixture of experts, borrows ranks of those) plus zero
stage, sp (on where tp > 1, unless --no-sp), schedule, microbatches (not given: the
fewest that fit) and virtual stages. With --search the given flags are fixed and the rest
is searched. A table by default; --json prints one JSON object: {"mode", "cluster",
"model", "engine", "predictions": [...]} (and "calibration" with --from-run; "note" where
the microbatches were chosen). Every shown prediction carries a step-time range.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

from tetrad.config import ModelConfig, model_preset
from tetrad.layout import SCHEDULES, Layout
from tetrad.plan.activations import RECOMPUTE
from tetrad.plan.calibrate import Run, calibrate, read_run
from tetrad.plan.candidates import layout_for
from tetrad.plan.cost import Planner
from tetrad.plan.engines import ENGINES
from tetrad.plan.hardware import CLUSTERS, Cluster, at_efficiency, calibrated, cluster_preset
from tetrad.plan.search import Space, divisors, priced, search

GiB = 2**30
MODEL_FLAGS = ("layers", "dim", "heads", "kv_heads", "vocab", "ffn_dim",
               "experts", "top_k", "moe_ffn_dim", "shared_experts", "dense_layers")  # fmt: skip
LAYOUT_FLAGS = ("dp", "fsdp", "tp", "pp", "cp", "ep", "zero_stage", "pp_schedule",
                "microbatches", "virtual_stages")  # fmt: skip


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The `tetrad plan` flags."""
    p.add_argument("--model", help="model preset (default llama3-8b, or the run's model)")
    for flag in MODEL_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=int, help=f"override model.{flag}")
    p.add_argument("--tie-embeddings", action="store_true", default=None)
    p.add_argument("--gpus", type=int, help="world size (required unless --from-run)")
    p.add_argument("--gpu", choices=sorted(CLUSTERS) + ["cpu"],
                   help="device and cluster preset (default h100; cpu: this machine, the "
                        "default with --from-run)")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, help="override the preset's GPUs per node")
    p.add_argument("--global-batch", type=int, help="sequences per step (or the run's)")
    p.add_argument("--seq-len", type=int, help="sequence length (or the run's)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="default bf16, or the run's")
    p.add_argument(
        "--fp8",
        choices=("tensorwise", "rowwise"),
        default="",
        help="the blocks' linears in FP8 (priced at the device's FP8 peak)",
    )
    p.add_argument(
        "--fp8-all-gather",
        action="store_true",
        help="with --fp8 tensorwise and ZeRO-3: the blocks' gathers move the FP8 weights in "
        "one byte a value (the search: where a layout gathers ZeRO-3 shards without tp)",
    )
    p.add_argument(
        "--no-error-feedback",
        action="store_true",
        help="with --reduce-dtype int8/fp8: no residuals kept (less memory)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=("fp32", "bf16", "int8", "fp8"),
        help="what gradients cross ranks in (default fp32; int8/fp8: 1 + 4/256 bytes a value)",
    )
    p.add_argument("--from-run", action="append", metavar="RUN", default=[],
                   help="a tetrad run directory (config.json, metrics.jsonl) on this "
                        "machine to fit efficiency and links to; repeatable")  # fmt: skip
    for flag in ("dp", "fsdp", "tp", "pp", "cp", "microbatches", "virtual_stages"):
        p.add_argument("--" + flag.replace("_", "-"), type=int)
    p.add_argument("--ep", type=int,
                   help="expert parallelism: ranks each MoE layer's experts are sharded over, "
                        "borrowed from the data (or tensor) ranks (docs/moe.md)")  # fmt: skip
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3))
    p.add_argument("--pp-schedule", choices=SCHEDULES)
    p.add_argument("--no-sp", action="store_true", help="tp > 1 without sequence parallelism")
    p.add_argument("--recompute", default="none", choices=RECOMPUTE,
                   help="activation recomputation to assume (tetrad: none)")  # fmt: skip
    p.add_argument("--engine", default="tetrad", choices=sorted(ENGINES),
                   help="whose overlap behaviour to assume (default tetrad)")  # fmt: skip
    p.add_argument("--efficiency", type=float, help="override the device's efficiency")
    p.add_argument("--calibration", metavar="BENCH_JSON",
                   help="links from a `tetrad bench comm --json` result")  # fmt: skip
    p.add_argument("--search", action="store_true", help="search layouts; given flags stay fixed")
    p.add_argument("--top", type=int, default=10, help="layouts to show with --search")
    p.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 8),
                   help="processes a --search walks its layouts in (default: the CPUs, "
                        "at most 8); the same answer with any")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def fill_from_runs(args: argparse.Namespace) -> list[Run]:
    """Read --from-run directories; unset job flags take the first run's values."""
    runs = [read_run(path) for path in args.from_run]
    first = runs[0].layout if runs else None
    defaults = {"gpu": "cpu" if runs else "h100", "dtype": "bf16"}
    if first is not None:
        defaults.update(gpus=first.world, global_batch=first.global_batch,
                        seq_len=first.seq_len, dtype=first.dtype_name)  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    missing = [f"--{k.replace('_', '-')}" for k in ("gpus", "global_batch", "seq_len")
               if getattr(args, k) is None]  # fmt: skip
    if missing:
        raise ValueError(f"{', '.join(missing)} required (or --from-run RUN)")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    return runs


def build_model(args: argparse.Namespace, runs: list[Run] | None = None) -> ModelConfig:
    """The preset (or the first run's model) with any shape flags applied."""
    overrides = {f: getattr(args, f) for f in MODEL_FLAGS if getattr(args, f) is not None}
    if args.tie_embeddings:
        overrides["tie_embeddings"] = True
    base = runs[0].model if args.model is None and runs else model_preset(args.model or "llama3-8b")
    return dataclasses.replace(base, **overrides)


def build_cluster(args: argparse.Namespace) -> Cluster:
    """The preset, with the calibration, node size and efficiency overrides."""
    cluster = cluster_preset(args.gpu)
    if args.calibration:
        cluster = calibrated(cluster, args.calibration)
    if args.gpus_per_node:
        cluster = dataclasses.replace(cluster, gpus_per_node=args.gpus_per_node)
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise ValueError(f"--efficiency must be in (0, 1], got {args.efficiency}")
        cluster = at_efficiency(cluster, args.efficiency)
    return cluster


def build_layout(args: argparse.Namespace, model: ModelConfig) -> Layout:
    """The full layout to predict: dp fills the world, microbatches default to pp."""
    given = {f: getattr(args, f) for f in LAYOUT_FLAGS if getattr(args, f) is not None}
    product = math.prod(given.get(a, 1) for a in ("fsdp", "tp", "pp", "cp"))
    if "dp" not in given:
        if args.gpus % product:
            raise ValueError(f"--gpus {args.gpus} is not divisible by fsdp*tp*pp*cp = {product}")
        given["dp"] = args.gpus // product
    world = given["dp"] * product
    if world != args.gpus:
        raise ValueError(
            f"dp*fsdp*tp*pp*cp = {given['dp']}*{product} = {world} != --gpus {args.gpus}"
        )
    given.setdefault("microbatches", given.get("pp", 1))
    if given.get("pp_schedule") in ("interleaved-1f1b", "zb-v"):
        given.setdefault("virtual_stages", 2)
    given["sp"] = given.get("tp", 1) > 1 and not args.no_sp
    given |= _reduction(args)
    return layout_for(model, args.global_batch, args.seq_len, args.dtype, world, args.fp8, **given)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Predict or search as the flags say; the JSON-ready answer."""
    runs = fill_from_runs(args)
    model, cluster = build_model(args, runs), build_cluster(args)
    engine = ENGINES[args.engine]
    if runs:
        cluster, calibration = calibrate(cluster, engine, runs, fit_links=not args.calibration)
    planner = Planner(cluster, engine, args.recompute)
    if args.search:
        base = _search_base(args, model)
        fixed = {f: getattr(args, f) for f in LAYOUT_FLAGS if getattr(args, f) is not None}
        space = Space(**fixed)
        preds = search(planner, base, model, args.gpus, space, top=args.top, jobs=args.jobs)
    else:
        lay, note = build_layout(args, model), ""
        if args.microbatches is None:
            lay, note = fewest_that_fit(planner, args, model, lay)
        preds = [priced(planner, lay, model)]
    answer = {
        "mode": "search" if args.search else "predict",
        "cluster": dataclasses.asdict(cluster),
        "model": dataclasses.asdict(model),
        "engine": dataclasses.asdict(engine),
        "predictions": [p.to_dict() for p in preds],
    }
    if runs:
        answer["calibration"] = dataclasses.asdict(calibration)
    if not args.search and note:
        answer["note"] = note
    return answer


def fewest_that_fit(planner: Planner, args: argparse.Namespace, model: ModelConfig,
                    lay: Layout) -> tuple[Layout, str]:  # fmt: skip
    """A fixed layout without --microbatches: the fewest microbatches (the largest
    microbatch) whose predicted memory fits, with a note saying so; `lay` (pp of them)
    with a note where none fits or the default does."""
    if planner.memory(lay, model).fits:
        return lay, ""
    for n in divisors(lay.global_batch // lay.data_ranks):
        try:
            cand = build_layout(argparse.Namespace(**{**vars(args), "microbatches": n}), model)
        except ValueError:
            continue
        if planner.memory(cand, model).fits:
            return cand, f"--microbatches {n}: the fewest that fit (the default, pp, does not)"
    return lay, "no microbatch count of this layout fits"


def _search_base(args: argparse.Namespace, model: ModelConfig) -> Layout:
    """The layout a search's candidates take their batch, dtypes and settings from; with
    --fp8-all-gather each candidate gathers in FP8 where it can (ZeRO-3 over fsdp > 1,
    tp 1: `candidates.candidate`), so the base, whose degrees are not searched, is not
    held to that."""
    carried = _reduction(args)
    gather = carried.pop("fp8_all_gather")
    if gather and args.fp8 != "tensorwise":
        raise ValueError(f"--fp8-all-gather with --fp8 {args.fp8!r}: it gathers tensorwise FP8 "
                         "weights (docs/low_precision.md)")  # fmt: skip
    base = layout_for(model, args.global_batch, args.seq_len, args.dtype, None, args.fp8, **carried)
    return dataclasses.replace(base, fp8_all_gather=gather)


def _reduction(args: argparse.Namespace) -> dict[str, Any]:
    """The gradient reduction's flags, as layout settings (none given: the defaults)."""
    out: dict[str, Any] = {"error_feedback": not args.no_error_feedback}
    out["fp8_all_gather"] = args.fp8_all_gather
    return out | ({"reduce_dtype": args.reduce_dtype} if args.reduce_dtype else {})


def main(args: argparse.Namespace) -> int:
    """Entry point of `tetrad plan` (after argument parsing)."""
    answer = run(args)
    if args.json:
        json.dump(answer, sys.stdout, indent=1)
        sys.stdout.write("\n")
    elif answer["mode"] == "search":
        print_search(answer)
    else:
        print_prediction(answer)
    return 0


# --- tables -------------------------------------------------------------------------------


def layout_code(lay: dict[str, Any]) -> str:
    """A layout in one short string: the degrees over 1 joined by a dot, the ZeRO stage
    (z2) where fsdp > 1, `nosp` for tp without SP, the schedule (with its virtual stages)
    where pp > 1, then m microbatches (x their size when over 1): `fsdp32·cp2·z2 m32`."""
    axes = ("dp", "fsdp", "tp", "pp", "cp", "ep")
    parts = [f"{a}{lay[a]}" for a in axes if lay.get(a, 1) > 1] or ["single"]
    if lay["fsdp"] > 1:
        parts.append(f"z{lay['zero_stage']}")
    if lay["tp"] > 1 and not lay["sp"]:
        parts.append("nosp")
    words = ["·".join(parts)]
    if lay["pp"] > 1:
        interleaved = lay["pp_schedule"] == "interleaved-1f1b"
        words.append(f"i1f1b/v{lay['virtual_stages']}" if interleaved else lay["pp_schedule"])
    size = lay["microbatch_size"]
    words.append(f"m{lay['microbatches']}" + (f"x{size}" if size > 1 else ""))
    return " ".join(words)


def memory_rows(mem: dict[str, Any]) -> list[tuple[str, str]]:
    """The steady figures, then the peak: its moment, the transients alive then, and what
    the device reserves beyond them; the fit check reads the last row."""
    peak = mem.get("peak") or {"moment": "-", "terms": []}
    steady = mem["model_state"] + mem["activations"]
    rows = [
        ("memory: model state", f"{mem['model_state'] / GiB:.2f} GiB"),
        ("memory: activations", f"{mem['activations'] / GiB:.2f} GiB"),
        ("memory: steady (state + activations)", f"{steady / GiB:.2f} GiB"),
        (f"memory: peak at {peak['moment']}", f"{mem['allocated'] / GiB:.2f} GiB"),
    ]
    rows += [(f"  {name}", f"{value / GiB:+.2f} GiB") for name, value in peak["terms"]]
    reserved = peak.get("reserved", [])
    rows += [(f"  reserved: {name}", f"{value / GiB:+.2f} GiB") for name, value in reserved]
    beyond = mem["total"] - mem["allocated"] - sum(value for _, value in reserved)
    rows += [
        ("  workspace and allocator", f"{beyond / GiB:+.2f} GiB"),
        ("memory: peak / capacity",
         f"{mem['total'] / GiB:.2f} / {mem['capacity'] / GiB:.1f} GiB"
         f" ({'fits' if mem['fits'] else 'DOES NOT FIT'})"),
    ]  # fmt: skip
    return rows


def print_prediction(answer: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    pred = answer["predictions"][0]
    table = Table(title=f"tetrad plan: {answer['model']['name']} on {pred['layout']['world']}"
                  f" x {answer['cluster']['device']['name']}")  # fmt: skip
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        ("layout", layout_code(pred["layout"])),
        ("step time", f"{pred['step_time_s']:.3f} s"),
        ("  range", "{:.3f} - {:.3f} s".format(*pred["step_time_range_s"])),
        ("tokens/s", f"{pred['tokens_per_s']:,.0f}"),
        ("TFLOP/s per GPU", f"{pred['tflops_per_gpu']:.1f}"),
        ("MFU", f"{100 * pred['mfu']:.1f}%"),
        ("pipeline bubble", f"{100 * pred['bubble_fraction']:.1f}%"),
    ]
    rows += [(f"  {k}", f"{v:.3f} s") for k, v in pred["breakdown"].items()]
    rows += memory_rows(pred["memory"])
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
    if answer.get("note"):
        print(answer["note"])


SEARCH_COLUMNS = ("#", "layout", "step", "range", "tokens/s", "MFU", "bubble", "GiB")


def search_table(answer: dict[str, Any]) -> list[str]:
    """The search's answer as plain lines, one layout a row (step and range in seconds):
    in 80 columns for layout strings of up to 27 characters, never wrapped or cut (a
    longer layout widens its column)."""
    preds = answer["predictions"]
    where = f"{preds[0]['layout']['world']} x {answer['cluster']['device']['name']}"
    rows = [
        (
            str(i),
            layout_code(p["layout"]),
            f"{p['step_time_s']:.2f}",
            "{:.1f}-{:.1f}".format(*p["step_time_range_s"]),
            f"{p['tokens_per_s']:,.0f}",
            f"{100 * p['mfu']:.1f}%",
            f"{100 * p['bubble_fraction']:.1f}%",
            f"{p['memory']['total'] / GiB:.1f}",
        )  # fmt: skip
        for i, p in enumerate(preds, 1)
    ]
    widths = [max(len(r[c]) for r in [SEARCH_COLUMNS, *rows]) for c in range(len(SEARCH_COLUMNS))]

    def line(cells) -> str:
        out = [c.ljust(w) if k == 1 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    title = f"tetrad plan --search: {answer['model']['name']} on {where} (seconds, GiB)"
    return [title, line(SEARCH_COLUMNS), *(line(r) for r in rows)]


def print_search(answer: dict[str, Any]) -> None:
    if not answer["predictions"]:
        print("no layout fits in memory")
        return
    print("\n".join(search_table(answer)))
