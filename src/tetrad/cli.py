"""The `tetrad` command: train, export, data prepare, generate, report, plan, bench."""

from __future__ import annotations

import argparse
import os
import sys

from tetrad.config import (
    DTYPES,
    RECOMPUTE,
    Config,
    ModelConfig,
    load_toml,
    model_preset,
    validate,
)
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
    "recompute": ("train", "recompute", str),
    "loss_chunk": ("train", "loss_chunk", int),
    "out": ("train", "out", str),
    "data": ("data", "source", str),
    "tokenizer": ("data", "tokenizer", str),
    "eval_every": ("train", "eval_every", int),
    "eval_batches": ("train", "eval_batches", int),
    "checkpoint_every": ("checkpoint", "every", int),
}
DEGREES = ("dp", "fsdp", "tp", "pp")
FLAG_HELP = {
    "data": "synthetic, stdlib (default), a text file or folder, or a prepared .u16/.u32 file",
    "tokenizer": "a local tokenizer.json for text data (default: bytes, vocabulary 256)",
    "eval_every": "every K steps (and at the end) log eval_loss on a held-out split",
    "eval_batches": "global batches in the held-out split (default 4)",
    "device": "auto (default: CUDA if available, else CPU), cpu or cuda",
    "peak_tflops": "declared dense peak of one device in TFLOP/s, for MFU (default: the "
    "table in devices.py; needed for a GPU not in it)",
    "recompute": "activation recomputation (default none): selective recomputes attention's "
    "core and the SwiGLU product in backward, full whole blocks from their inputs",
    "loss_chunk": "apply the head and the loss this many tokens at a time, never holding "
    "full logits (default 1024; 0: full logits)",
}


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
        if flag == "zero_stage":
            kw = {"choices": (1, 2, 3)}
        if flag == "recompute":
            kw = {"choices": RECOMPUTE}
        if flag == "loss_chunk":
            kw = {"metavar": "TOKENS"}
        p.add_argument("--" + flag.replace("_", "-"), type=typ, help=FLAG_HELP.get(flag), **kw)
    p.add_argument("--sp", action="store_true", default=None, help="sequence parallelism (tp>1)")
    p.add_argument("--tie-embeddings", action="store_true", default=None)
    p.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="continue from the newest checkpoint under OUT/checkpoints, in any layout",
    )
    p.add_argument(
        "--init-from-hf",
        metavar="DIR",
        help="start from a local Hugging Face Llama directory (config.json + safetensors): "
        "the model's shape and weights; shape flags that contradict config.json are errors",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        default=None,
        help="also write TensorBoard event files to OUT/tensorboard (needs tetrad[tensorboard])",
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
    if args.init_from_hf:
        cfg.model.init_from_hf = args.init_from_hf
    if cfg.model.init_from_hf:
        cfg.model = hf_model(cfg, args)
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
    if args.tensorboard:
        cfg.train.tensorboard = True
    if cfg.data.tokenizer:  # absolute: export and generate find it from anywhere
        cfg.data.tokenizer = os.path.abspath(cfg.data.tokenizer)
    if args.no_progress:
        cfg.train.progress = False
    return cfg


def hf_model(cfg: Config, args: argparse.Namespace) -> ModelConfig:
    """The model of --init-from-hf DIR; a flag or [model] value that contradicts its
    config.json is an error naming both."""
    from tetrad.interop import hf

    if args.model:
        raise ValueError(f"--model {args.model} and --init-from-hf both choose the model")
    defaults = ModelConfig()
    given = {  # values a --config file set
        f"[model] {f}": (f, getattr(cfg.model, f))
        for f in hf.HF_KEYS
        if getattr(cfg.model, f) != getattr(defaults, f)
    }
    for flag, (section, name, _) in TRAIN_FLAGS.items():
        if section == "model" and getattr(args, flag) is not None:
            given[f"--{flag.replace('_', '-')}"] = (name, getattr(args, flag))
    if args.tie_embeddings:
        given["--tie-embeddings"] = ("tie_embeddings", True)
    return hf.model_config(cfg.model.init_from_hf, given)


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
        if cfg.model.init_from_hf:  # every tensor's name, dtype and shape (headers only)
            from tetrad.interop.hf import HFWeights

            HFWeights(cfg.model.init_from_hf, cfg.model)
        if nproc > 1:
            return launch_train(nproc, argv, cfg)
    from tetrad.train.run import run

    threads = args.threads or int(os.environ.get("TETRAD_THREADS", "0"))
    run(cfg, threads=threads or None, timeline=args.timeline)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint (or a run's newest) as a Hugging Face Llama directory."""
    from tetrad.interop import hf
    from tetrad.train.checkpoint import load_model, resolve

    source = resolve(args.source)
    cfg, state = load_model(source)
    files = hf.save(state, cfg.model, args.hf, int(args.max_shard_mb * 2**20), DTYPES[args.dtype])
    if cfg.data.tokenizer:
        from tetrad.interop.tokenizer import export_tokenizer

        files += export_tokenizer(cfg.data.tokenizer, args.hf, cfg.train.seq_len)
    print(f"tetrad: exported {source} to {args.hf}: " + ", ".join(f.name for f in files))
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    """`tetrad data prepare TEXT --tokenizer T --out FILE`: a token file and its sidecar."""
    from tetrad.interop.tokenizer import prepare

    info = prepare(args.text, args.tokenizer, args.out)
    print(
        f"tetrad: {info['tokens']:,} tokens of {args.text} -> {args.out} "
        f"(vocabulary {info['vocab_size']:,}, tokenizer sha256 {info['tokenizer_sha256'][:12]})"
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tetrad.generate import generate

    text = generate(
        args.run, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed
    )
    print(args.prompt + text)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from tetrad.report import report

    text, files = report(args.run, args.out)
    print(text, end="")
    print(f"tetrad: wrote {', '.join(str(f) for f in files)}")
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
    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face Llama directory")
    export.add_argument("source", help="a checkpoint directory, or a run (its newest checkpoint)")
    export.add_argument("--hf", required=True, metavar="DIR", help="the output directory")
    export.add_argument(
        "--max-shard-mb",
        type=float,
        default=4096,
        help="largest safetensors file (MiB); larger models get shards and an index",
    )
    export.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    data = sub.add_parser("data", help="tokenise text once: tetrad data prepare TEXT ...")
    data.add_argument("what", choices=["prepare"])
    data.add_argument("text", help="a text file, or a folder of them (read in name order)")
    data.add_argument("--tokenizer", required=True, help="a tokenizer.json (or its folder)")
    data.add_argument(
        "--out", required=True, help="the token file: NAME.u16 or NAME.u32 (+ NAME.u16.json)"
    )
    gen = sub.add_parser("generate", help="continue a prompt with a run's newest checkpoint")
    gen.add_argument("run", help="a run directory (its newest checkpoint) or a checkpoint")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely")
    gen.add_argument("--seed", type=int, default=0)
    rep = sub.add_parser("report", help="plots (PNG) and a summary of a run's metrics")
    rep.add_argument("run", help="a run directory (holding metrics.jsonl)")
    rep.add_argument("--out", help="where to write (default: RUN/report)")
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
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "data":
            return cmd_data(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "plan":
            from tetrad.plan.cli import main as plan_main

            return plan_main(args)
        return cmd_bench(args, argv)
    except ValueError as e:
        print(f"tetrad: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
