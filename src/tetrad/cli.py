"""The `tetrad` command: train, export, data prepare, generate, report, plan, bench."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

from tetrad.config import (
    DTYPES,
    MODEL_PRESETS,
    Config,
    ModelConfig,
    from_dict,
    load_raw,
    model_preset,
)
from tetrad.devices import pick
from tetrad.errors import EXIT_FAILED, EXIT_PREEMPTED, EXIT_USAGE, rank_and_attempt, report
from tetrad.launch import LOG_DIR, die_with_parent, launch, under_torchrun
from tetrad.layout import ELASTIC_AXES, Layout, elastic_config


def degree(text: str) -> int | str:
    """A degree flag's value: a positive count, or (--dp, --fsdp) "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid degree {text!r}: a count, or auto") from None


def flag(dest: str) -> str:
    return dest.replace("_", "-")


def config_options() -> dict[str, tuple[str, Field]]:
    """`tetrad train`'s options that set a config field (those with `cli` metadata,
    config.py), by argparse dest: (section, field). Every one is also settable in a --config
    TOML file (an elastic degree there: [parallel] elastic = "dp")."""
    options: dict[str, tuple[str, Field]] = {}
    for section in fields(Config):
        for f in fields(section.default_factory):
            if "cli" not in f.metadata:
                continue
            dest = (f.metadata["cli"]["flag"] or f.name).replace("-", "_")
            if dest in options:
                first = f"{options[dest][0]}.{options[dest][1].name}"
                raise ValueError(
                    f"--{flag(dest)} is declared twice: {first}, {section.name}.{f.name}"
                )
            options[dest] = (section.name, f)
    return options


TRAIN_OPTIONS = config_options()


def option_kwargs(section: str, f: Field) -> dict[str, Any]:
    """add_argument's keywords for a config field's option; its default is None (not given:
    the --config file's value, or the field's default, stands)."""
    meta = f.metadata["cli"]
    kw: dict[str, Any] = {"help": meta["help"], "default": None}
    if isinstance(f.default, bool):  # the flag sets the opposite of the default
        return kw | {"action": "store_const", "const": not f.default}
    elastic = section == "parallel" and f.name in ELASTIC_AXES
    kw["type"] = degree if elastic else type(f.default)
    kw["metavar"] = "N|auto" if elastic else meta["metavar"]
    kw["choices"] = meta["choices"] or None
    return kw


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with [model] [parallel] [train] [data] tables")
    p.add_argument(
        "--nproc",
        type=int,
        help="launch N local processes through torchrun (default: the layout's world size; "
        "2 data ranks when no degree is given). Omit it when already under torchrun.",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart all workers up to N times after a failure (torchrun's elastic agent); "
        "the restarted workers resume from the newest valid checkpoint (in memory first, "
        "with --local-checkpoint-every)",
    )
    p.add_argument(
        "--nnodes",
        default="1",
        metavar="N|MIN:MAX",
        help="nodes in the job (each runs this command); MIN:MAX (with --dp auto or --fsdp "
        "auto, and --max-restarts): the job goes on with as few as MIN after losing nodes",
    )
    p.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="with --nnodes > 1: the c10d rendezvous every node's launcher meets at",
    )
    p.add_argument(
        "--rdzv-conf",
        metavar="K=V,...",
        help="torchrun's rendezvous settings, e.g. last_call_timeout=10,keep_alive_interval=2 "
        "(how long a re-forming job waits for nodes, how soon a lost one is declared dead)",
    )
    p.add_argument("--model", help=f"model preset (docs/models.md): {', '.join(MODEL_PRESETS)}")
    p.add_argument("--threads", type=int, help="torch threads per process (default: cores/N)")
    p.add_argument(
        "--timeline",
        metavar="DIR",
        help="pp>1: write the last step's measured and simulated pipeline timeline to "
        "DIR/timeline.png, DIR/timeline.json and DIR/timeline_sim.json (Chrome traces)",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for dest, (section, f) in TRAIN_OPTIONS.items():
        if section not in groups:
            about = f"also settable in a --config file's [{section}] table"
            groups[section] = p.add_argument_group(f"[{section}] options", about)
        groups[section].add_argument("--" + flag(dest), dest=dest, **option_kwargs(section, f))


def build_config(args: argparse.Namespace) -> Config:
    """Defaults < --config file < --model preset < individual flags."""
    raw = load_raw(args.config) if args.config else {}
    cfg, model_table = from_dict(raw), raw.get("model", {})
    if args.model:
        cfg.model = model_preset(args.model)
    if hf_dir := args.init_from_hf or cfg.model.init_from_hf:
        cfg.model = hf_model(hf_dir, args, model_table)
    for dest, (section, f) in TRAIN_OPTIONS.items():
        value = getattr(args, dest)
        if value == "auto" and dest in ELASTIC_AXES:  # only their type lets auto through
            value = elastic_axis(cfg, dest)
        if value is not None:
            setattr(getattr(cfg, section), f.name, value)
    if args.experts is not None:
        cfg.model.family = experts_family(cfg.model.family, args.experts)
    if cfg.data.tokenizer:  # absolute: export and generate find it from anywhere
        cfg.data.tokenizer = os.path.abspath(cfg.data.tokenizer)
    args.vocab_note = vocab_from_data(cfg, args, model_table)
    return cfg


def elastic_axis(cfg: Config, flag: str) -> int:
    """`--FLAG auto`: FLAG is the elastic degree (resolved for each world, `elastic_config`);
    returns the placeholder degree it has until then."""
    if cfg.parallel.elastic and cfg.parallel.elastic != flag:
        raise ValueError(f"--{cfg.parallel.elastic} auto and --{flag} auto: one degree at most "
                         "can follow the world")  # fmt: skip
    cfg.parallel.elastic = flag
    return 1


def node_range(text: str) -> tuple[int, int]:
    """--nnodes N or MIN:MAX as (MIN, MAX)."""
    lo, _, hi = str(text).partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--nnodes {text!r} must be N or MIN:MAX (counts of nodes)") from None
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"--nnodes {text}: need 1 <= MIN <= MAX, got MIN={lo_n}, MAX={hi_n}")
    return lo_n, hi_n


def check_elastic(cfg: Config, args: argparse.Namespace, nproc: int, lo: int, hi: int) -> None:
    """--nnodes MIN:MAX (`lo`, `hi`) needs one elastic degree and restarts, and every world
    from MIN to MAX nodes must hold the layout (the fixed degrees, the global batch): refused
    here, once, naming the node count, rather than when a node is lost."""
    p = cfg.parallel
    if lo != hi and not p.elastic:
        autos = " or ".join(f"--{a} auto" for a in ELASTIC_AXES)
        raise ValueError(
            f"--nnodes {args.nnodes} lets the world change: give one elastic degree ({autos})"
        )
    if lo != hi and args.max_restarts < 1:
        raise ValueError(
            f"--nnodes {args.nnodes}: the job re-forms after a lost node by restarting its "
            f"workers; give --max-restarts >= 1, got {args.max_restarts}"
        )
    if not p.elastic:
        return
    from tetrad.train.checkpoint import checkpoint_root, committed

    if not cfg.checkpoint.resume:
        if committed(checkpoint_root(cfg)):
            raise ValueError(
                f"{checkpoint_root(cfg)} holds checkpoints, and every start of an elastic job's "
                "workers resumes from them: pass --resume to continue (as a node joining a "
                "running job does), or choose another --out"
            )
        free_local_checkpoints(cfg)  # an earlier job's generations on this node are not ours
    p.elastic_max_world = p.elastic_max_world or nproc * hi
    for nodes in range(lo, hi + 1):
        world = nodes * nproc
        try:
            Layout.build(elastic_config(cfg, world), world)
        except ValueError as e:
            raise ValueError(f"--nnodes {args.nnodes} --nproc {nproc}: at {nodes} node(s), "
                             f"{world} ranks: {e}") from None  # fmt: skip


def vocab_from_data(cfg: Config, args: argparse.Namespace, model_table: dict[str, Any]) -> str:
    """With a tokenizer (or a token file it made) and no vocabulary given (by --vocab, the
    --config file's [model] table or --init-from-hf), the model's vocabulary is the
    tokenizer's, padded; returns the line that says so ("" when nothing changed). A given
    vocabulary that is too small stays an error (the data checks)."""
    given = args.vocab is not None or cfg.model.init_from_hf or "vocab" in model_table
    if given or cfg.data.source == "synthetic":
        return ""
    from tetrad.interop.tokenizer import data_vocab, padded_vocab

    size = data_vocab(cfg.data.source, cfg.data.tokenizer)
    if size is None:
        return ""
    cfg.model.vocab = padded_vocab(size, cfg.parallel.tp)
    where = f"tokenizer {cfg.data.tokenizer}" if cfg.data.tokenizer else cfg.data.source
    return (
        f"tetrad: vocabulary {cfg.model.vocab} from {where} ({size} tokens, padded to a "
        f"multiple of 128*tp; --vocab to choose)"
    )


def hf_model(directory: str, args: argparse.Namespace, model_table: dict[str, Any]) -> ModelConfig:
    """The model of --init-from-hf DIR (`directory`); a flag or a value of the --config
    file's [model] table that contradicts its config.json is an error naming both."""
    from tetrad.interop import hf

    if args.model:
        raise ValueError(f"--model {args.model} and --init-from-hf both choose the model")
    given = {f"[model] {f}": (f, v) for f, v in model_table.items() if f in hf.HF_KEYS}
    for dest, (section, f) in TRAIN_OPTIONS.items():
        value = getattr(args, dest)
        if section == "model" and f.name != "init_from_hf" and value is not None:
            given[f"--{flag(dest)}"] = (f.name, value)
    return hf.model_config(directory, given)


def fill_world(cfg: Config, args: argparse.Namespace, nnodes: int) -> int:
    """Number of local processes to launch (per node, of at most `nnodes`); dp fills the
    world when no degree was given."""
    explicit = bool(args.config) or any(getattr(args, d) is not None for d in cfg.parallel.degrees)
    if cfg.parallel.elastic and args.nproc is None:
        raise ValueError(f"--{cfg.parallel.elastic} auto needs --nproc N: the ranks of each node")
    if args.nproc is None:
        if not explicit and cfg.parallel.world == 1:
            cfg.parallel.dp = 2 * nnodes  # the default job: two data-parallel CPU processes
        return max(1, cfg.parallel.world // nnodes)
    if not explicit:
        cfg.parallel.dp = args.nproc * nnodes
    return args.nproc


def launch_train(nproc: int, argv: list[str], cfg: Config, args: argparse.Namespace) -> int:
    """Launch the ranks, each told the degrees this process settled (dp may fill the world;
    an elastic degree stays auto, with the world its microbatch size is for)."""
    p = cfg.parallel
    degrees = [f"--{d}={'auto' if d == p.elastic else n}" for d, n in p.degrees.items()]
    if p.elastic:
        degrees.append(f"--elastic-max-world={p.elastic_max_world}")
    nodes = (args.nnodes, args.rdzv_endpoint, args.rdzv_conf)  # and where they meet
    return launch(nproc, [*argv, *degrees], cfg.train.out, args.max_restarts, *nodes)


def prepare_out(out: str) -> None:
    """Create OUT (and OUT/logs) before launching, so a bad --out fails once, here."""
    try:
        (Path(out) / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out!r} cannot be created: {e.strerror or e}") from None


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = build_config(args)
    if args.vocab_note and (not under_torchrun() or own_torchrun_rank0()):
        print(args.vocab_note, flush=True)
    if under_torchrun():
        return worker(cfg, args)
    lo, hi = node_range(args.nnodes)
    nproc = fill_world(cfg, args, hi)
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if hi > 1 and not args.rdzv_endpoint:
        raise ValueError(f"--nnodes={args.nnodes} needs --rdzv-endpoint HOST:PORT")
    check_elastic(cfg, args, nproc, lo, hi)
    world = nproc * hi
    layout = Layout.build(elastic_config(cfg, world), world)  # checked once, here
    t = cfg.train
    pick(t.device, t.dtype, t.peak_tflops, nproc, 0)  # the device checks, once, here
    from tetrad.train.checkpoint import checkpoint_root, find_resume

    prepare_out(cfg.train.out)
    find_resume(checkpoint_root(cfg), cfg)  # a refused --out fails once, before launching
    if cfg.model.init_from_hf:  # every tensor's name, dtype and shape (headers only)
        from tetrad.interop.hf import HFWeights

        HFWeights(cfg.model.init_from_hf, cfg.model)
    if nproc > 1 or hi > 1 or args.max_restarts > 0:
        try:
            return launch_train(nproc, argv, cfg, args)
        finally:
            free_local_checkpoints(cfg)
    return worker(cfg, args, layout)


def free_local_checkpoints(cfg: Config) -> None:
    """This node's in-memory checkpoints, once the job is over however it ended: memory
    that nothing after the job reads (the durable checkpoints are what --resume uses)."""
    if cfg.checkpoint.local_every > 0:
        from tetrad.train.local_checkpoint import clear, local_root

        clear(local_root(cfg))


def own_torchrun_rank0() -> bool:
    """Rank 0 of a torchrun the user started (tetrad's own launcher speaks for its ranks)."""
    return os.environ.get("RANK") == "0" and not os.environ.get(LOG_DIR)


def worker(cfg: Config, args: argparse.Namespace, layout: Layout | None = None) -> int:
    """One rank's job: train, and turn its end into an exit code and (under the launcher)
    a report: 0 done, 75 stopped by a signal after saving, 1 an error, 2 bad input."""
    from tetrad.train.run import run
    from tetrad.train.stop import Preempted

    rank, attempt = rank_and_attempt()
    if under_torchrun():
        die_with_parent()  # torchrun gone (killed): so are we
        if os.environ.get(LOG_DIR):
            _log_to_files(Path(os.environ[LOG_DIR]), rank, attempt)
    if attempt > 0 or cfg.parallel.elastic:
        # a restarted worker continues from the newest checkpoint; so does every start of an
        # elastic job's workers: a change of membership (a node joining) restarts them
        # without counting an attempt (the launcher started this job in a clean state)
        cfg.checkpoint.resume = True
    threads = args.threads or int(os.environ.get("TETRAD_THREADS", "0"))
    try:
        run(cfg, threads=threads or None, timeline=args.timeline, layout=layout)
        # done, and the process group destroyed: leave without the interpreter's teardown,
        # in which gloo's threads sometimes abort the process ("terminate called without
        # an active exception") after the job has succeeded
        return _leave(0)
    except Preempted as e:
        reported = report("preempted", str(e), EXIT_PREEMPTED, step=e.step, path=str(e.path))
        if rank == 0 and not reported:  # under the launcher, the launcher says it once
            print(f"tetrad: {e}; continue with --resume", flush=True)
        return _leave(EXIT_PREEMPTED)
    except BaseException as e:  # noqa: BLE001 - every failure becomes one report
        if not under_torchrun() and isinstance(e, ValueError):
            raise  # a single process: main prints it as usual
        traceback.print_exc()
        code = EXIT_USAGE if isinstance(e, ValueError) else EXIT_FAILED
        message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        message = f"rank {rank}: {message.strip()}"
        if not report("error", message, code):
            print(f"tetrad: error: {message}", file=sys.stderr, flush=True)
        return _leave(code)


def _leave(code: int) -> int:
    """Exit now under torchrun: a process group's teardown must not hang (or abort) a
    rank whose outcome is decided and reported."""
    if not under_torchrun():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _log_to_files(logs: Path, rank: int, attempt: int) -> None:
    """Send this rank's stderr (and stdout, but rank 0's) to OUT/logs/rank<R>.*.log."""
    for name, fd in [("stderr", 2)] + ([("stdout", 1)] if rank != 0 else []):
        with open(logs / f"rank{rank}.{name}.log", "ab") as fh:
            fh.write(f"--- attempt {attempt}, pid {os.getpid()} ---\n".encode())
            fh.flush()
            os.dup2(fh.fileno(), fd)


def experts_family(family: str, experts: int) -> str:
    """The family `--experts N` leaves: experts make a dense family a mixture of experts
    ("moe"), none make a mixture a dense Llama; a mixture's own family (DeepSeek-V3) stays."""
    from tetrad.models.families import FAMILIES

    if (experts > 0) == (FAMILIES[family].moe is not None):
        return family
    return "moe" if experts > 0 else "llama"


def cmd_export(args: argparse.Namespace) -> None:
    """A checkpoint (or a run's newest) as a Hugging Face Llama directory."""
    from tetrad.interop import hf
    from tetrad.train.checkpoint import load_model, resolve

    source = resolve(args.source)
    cfg, state = load_model(source, buffers=True)  # a router's bias: DeepSeek-V3 keeps it
    files = hf.save(state, cfg.model, args.hf, int(args.max_shard_mb * 2**20), DTYPES[args.dtype])
    if cfg.data.tokenizer:
        from tetrad.interop.tokenizer import export_tokenizer

        files += export_tokenizer(cfg.data.tokenizer, args.hf, cfg.train.seq_len)
    print(f"tetrad: exported {source} to {args.hf}: " + ", ".join(f.name for f in files))


def cmd_data(args: argparse.Namespace) -> None:
    """`tetrad data prepare TEXT --tokenizer T --out FILE`: a token file and its sidecar."""
    from tetrad.interop.tokenizer import prepare

    info = prepare(args.text, args.tokenizer, args.out)
    print(
        f"tetrad: {info['tokens']:,} tokens of {args.text} -> {args.out} "
        f"(vocabulary {info['vocab_size']:,}, tokenizer sha256 {info['tokenizer_sha256'][:12]})"
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from tetrad.generate import Sampling, generate

    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    text = generate(args.run, args.prompt, args.max_new_tokens, sampling, args.seed)
    print(args.prompt + text)


def cmd_report(args: argparse.Namespace) -> None:
    from tetrad.report import report

    text, files = report(args.run, args.out)
    print(text, end="")
    print(f"tetrad: wrote {', '.join(str(f) for f in files)}")


def add_generate_args(gen: argparse.ArgumentParser) -> None:
    """`tetrad generate`'s flags; the sampling defaults are `generate.Sampling`'s."""
    from tetrad.generate import Sampling

    d = Sampling()
    gen.add_argument("run", help="a run directory (its newest checkpoint) or a checkpoint")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    temperature = f"divides the logits (default {d.temperature}); 0: greedy (argmax)"
    top_k = f"draw from the k most likely tokens only (default {d.top_k}; 0: no limit)"
    top_p = f"then from the fewest whose probabilities sum to p (default {d.top_p}; 1: no limit)"
    gen.add_argument("--temperature", type=float, default=d.temperature, help=temperature)
    gen.add_argument("--top-k", type=int, default=d.top_k, help=top_k)
    gen.add_argument("--top-p", type=float, default=d.top_p, help=top_p)
    seed = "the draws' seed (default 0): the same seed, the same text"
    gen.add_argument("--seed", type=int, default=0, help=seed)


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
    add_generate_args(gen)
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
    commands = dict(generate=cmd_generate, report=cmd_report, data=cmd_data, export=cmd_export)
    try:
        if args.command == "train":
            return cmd_train(args, argv)
        if args.command in commands:  # these end well or raise
            commands[args.command](args)
            return 0
        if args.command == "plan":
            from tetrad.plan.cli import main as plan_main

            return plan_main(args)
        from tetrad.commbench import main as bench_main

        return bench_main(args, argv)
    except ValueError as e:
        print(f"tetrad: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
