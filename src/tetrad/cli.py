"""The `tetrad` command: train, bench, and the pipeline timeline picture."""

from __future__ import annotations

import argparse
import os
import sys

from tetrad.config import Config, load_toml, model_preset, validate
from tetrad.devices import pick
from tetrad.launch import launch, under_torchrun
from tetrad.parallel.pipeline.schedules import SCHEDULES

# flag -> (section, field); every one of these is also settable in a --config TOML file
TRAIN_FLAGS = {
    "dp": ("parallel", "dp", int),
    "fsdp": ("parallel", "fsdp", int),
    "tp": ("parallel", "tp", int),
    "pp": ("parallel", "pp", int),
    "zero_stage": ("parallel", "zero_stage", int),
    "pp_schedule": ("parallel", "pp_schedule", str),
    "microbatches": ("parallel", "microbatches", int),
    "virtual_stages": ("parallel", "virtual_stages", int),
    "pp_split": ("parallel", "pp_split", str),
    "bucket_mb": ("parallel", "bucket_mb", float),
    "layers": ("model", "layers", int),
    "dim": ("model", "dim", int),
    "heads": ("model", "heads", int),
    "kv_heads": ("model", "kv_heads", int),
    "vocab": ("model", "vocab", int),
    "seq_len": ("train", "seq_len", int),
    "global_batch": ("train", "global_batch", int),
    "steps": ("train", "steps", int),
    "lr": ("train", "lr", float),
    "seed": ("train", "seed", int),
    "dtype": ("train", "dtype", str),
    "device": ("train", "device", str),
    "peak_tflops": ("train", "peak_tflops", float),
    "out": ("train", "out", str),
    "data": ("data", "source", str),
    "checkpoint_every": ("checkpoint", "every", int),
}
DEGREES = ("dp", "fsdp", "tp", "pp")


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with [model] [parallel] [train] [data] tables")
    p.add_argument(
        "--nproc",
        type=int,
        help="launch N local processes through torchrun (default: the layout's world size; "
        "2 data ranks when no degree is given). Omit it when already under torchrun.",
    )
    p.add_argument("--model", help="model preset: tiny, small, base, llama3-8b, llama3-70b")
    for flag, (_, _, typ) in TRAIN_FLAGS.items():
        kw = {"choices": SCHEDULES} if flag == "pp_schedule" else {}
        if flag == "dtype":
            kw = {"choices": ("fp32", "bf16")}
        if flag == "device":
            kw = {"choices": ("auto", "cpu", "cuda")}
        if flag == "peak_tflops":
            kw = {"help": "declared dense peak of one device, for MFU (default: from the table)"}
        if flag == "zero_stage":
            kw = {"choices": (1, 2, 3)}
        p.add_argument("--" + flag.replace("_", "-"), type=typ, **kw)
    p.add_argument("--sp", action="store_true", default=None, help="sequence parallelism (tp>1)")
    p.add_argument("--tie-embeddings", action="store_true", default=None)
    p.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="continue from the newest checkpoint under OUT/checkpoints, in any layout",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.add_argument("--threads", type=int, help="torch threads per process (default: cores/N)")
    p.add_argument(
        "--timeline",
        metavar="DIR",
        help="pp>1: write the last step's measured and simulated pipeline timeline to "
        "DIR/timeline.png, DIR/timeline.json and DIR/timeline_sim.json (Chrome traces)",
    )


def build_config(args: argparse.Namespace) -> Config:
    """Defaults < --config file < --model preset < individual flags."""
    cfg = load_toml(args.config) if args.config else Config()
    if args.model:
        cfg.model = model_preset(args.model)
    for flag, (section, name, _) in TRAIN_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            setattr(getattr(cfg, section), name, value)
    if args.sp:
        cfg.parallel.sp = True
    if args.tie_embeddings:
        cfg.model.tie_embeddings = True
    if args.resume:
        cfg.checkpoint.resume = True
    if args.no_progress:
        cfg.train.progress = False
    return cfg


def fill_world(cfg: Config, args: argparse.Namespace) -> int:
    """Number of local processes to launch; dp fills the world when no degree was given."""
    explicit = any(getattr(args, d) is not None for d in DEGREES) or bool(args.config)
    if args.nproc is None:
        if not explicit and cfg.parallel.world_size == 1:
            cfg.parallel.dp = 2  # the default job: two data-parallel CPU processes
        return cfg.parallel.world_size
    if not explicit:
        cfg.parallel.dp = args.nproc
    return args.nproc


def launch_train(nproc: int, argv: list[str], cfg: Config) -> int:
    """Launch the ranks, each told the degrees this process settled (dp may fill the world)."""
    return launch(nproc, [*argv, *(f"--{d}={getattr(cfg.parallel, d)}" for d in DEGREES)])


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = build_config(args)
    if not under_torchrun():
        nproc = fill_world(cfg, args)
        validate(cfg, nproc)
        t = cfg.train
        pick(t.device, t.dtype, t.peak_tflops, nproc, 0)  # the device checks, once, here
        from tetrad.train.checkpoint import checkpoint_root, find_resume

        find_resume(checkpoint_root(cfg), cfg)  # a refused --out fails once, before launching
        if nproc > 1:
            return launch_train(nproc, argv, cfg)
    from tetrad.train.run import run

    threads = args.threads or int(os.environ.get("TETRAD_THREADS", "0"))
    run(cfg, threads=threads or None, timeline=args.timeline)
    return 0


def cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    from tetrad.commbench import main as bench_main

    return bench_main(args, argv)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tetrad", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a model (default: small Llama, stdlib corpus, 2 CPU ranks)"
    )
    add_train_args(train)
    bench = sub.add_parser("bench", help="measure the collectives: tetrad bench comm --nproc N")
    bench.add_argument("what", choices=["comm"])
    bench.add_argument("--nproc", type=int, default=2)
    bench.add_argument("--min-bytes", type=int, default=1024)
    bench.add_argument("--max-bytes", type=int, default=256 * 2**20)
    bench.add_argument("--factor", type=int, default=4, help="size step: 2 or 4 (default)")
    bench.add_argument("--ops", default="all", help="comma-separated subset of the operations")
    bench.add_argument("--iters", type=int, default=20, help="timed calls per size (at most)")
    bench.add_argument("--seconds", type=float, default=0.5, help="time budget per size and op")
    bench.add_argument("--json", help="also write the results to this JSON file")
    from tetrad.plan.cli import add_plan_args

    plan = sub.add_parser("plan", help="predict memory and step time of a layout, or search")
    add_plan_args(plan)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, argv)
        if args.command == "plan":
            from tetrad.plan.cli import main as plan_main

            return plan_main(args)
        return cmd_bench(args, argv)
    except ValueError as e:
        print(f"tetrad: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
