"""tetrad's pipeline schedules against torch.distributed.pipelining, side by side.

Phase 1, the schedules, at two shapes. Same model (tetrad's Llama), same stages (tetrad's
balanced split; the peer's `PipelineStage` wraps each rank's span of the same module,
from the same initial weights), same batches, same loss (full logits and cross-entropy on
both sides: tetrad runs with loss_chunk=0, so both compute the same thing), AdamW and
clipping, same world (gloo, 1 thread per rank), in the same processes:

  base    8 layers, dim 256, 8 heads, 4 kv heads, vocab 8192; 8 x 128 tokens per step in
          8 microbatches (one sequence each)
  small   8 layers, dim 128, 4 heads, 2 kv heads, vocab 2048; 16 x 128 tokens in 8
          microbatches (two sequences each): short actions, where per-action overhead
          shows

Each tetrad schedule against the torch schedule it is compared with (the ratios in the
report pair exactly these):

  tetrad-1f1b   (1 stage per rank)   torch-1f1b   Schedule1F1B
  tetrad-zb-h1  (1 stage per rank)   torch-zb     ScheduleInterleavedZeroBubble with one
                                                  stage per rank (torch's ZB-H1 equivalent)
  tetrad-zb-v   (2 stages per rank,  torch-zbv    ScheduleZBVZeroBubble (the same V
                 V placement)                     placement, the same stages)
  tetrad-zb-v                        torch-dualpipev  ScheduleDualPipeV (V placement;
                                                  DeepSeek's DualPipe folded onto pp ranks;
                                                  tetrad has no DualPipe, its zb-v is the
                                                  nearest schedule it runs)

The V runners split the model into 2 x pp stages, tetrad's split for zb-v, which the peer's
`PipelineStage`s wrap one chunk each.

With `--single`, each side's single process joins phase 1 (tetrad's Trainer at pp = 1 and
a plain torch loop: the same model, the whole batch in one forward and backward, clipping,
fused AdamW; every rank runs its own copy at once, one core each), and each shape reports
each side's 1F1B speed-up over its own single process and their ratio, round by round.
`--shapes` and `--runners` pick phase 1's shapes and runners (the small-microbatch
question: `--shapes small --runners tetrad-1f1b,torch-1f1b --single`).

Phase 2, the bubbles (base shape, tetrad): every schedule (gpipe, 1f1b, interleaved-1f1b
and zb-v with 2 stages per rank, zb-h1), each step's measured bubble against the
simulator's at the costs measured in that step: from compute and transfer costs alone,
and with the runtime's own overhead per compute and per transfer, learned from the same
step (measure.estimate_overhead).

Phase 3, the split. The base model with a 32000-token vocabulary (the head then costs
several layers): tetrad 1F1B on its FLOP-balanced split, on the split balanced on costs
timed in a warm-up (`--pp-split measured`) and on the cost-blind even split, and the
simulator's prediction for the first and the last.

Every round runs one step of each runner, in an order that rotates between rounds;
tokens/s is the median over rounds and each ratio the median of the rounds' ratios, with
its spread (harness.py), so load that comes and goes on a shared machine hits both sides
of a ratio alike. The peer's optimizer step is harness.py's.

Bubble fraction, two ways. "timeline": 1 - busy / (pp x makespan) from the compute
intervals tetrad's runtime records (its picture), next to the simulator's prediction at
the step's measured median costs; "cpu": 1 - (main-thread CPU seconds summed over ranks)
/ (pp x step wall time), which needs no instrumentation and so is measured for the peer
too; it counts framework overhead as busy. Activation memory: the peak bytes of distinct
tensors saved for backward (autograd's saved-tensor hooks), plus, for tetrad, stage
outputs awaiting their send and inputs of deferred weight gradients. Both sides are
metered in their first step only: tetrad's runtime counts on its first step (then every
`meter_every` steps, 0 here: never again) and frees sent outputs and reuses buffers by
what it learned; torch's users run no meter, so the peer's timed steps do not pay the
hooks either.

Each tokens/s ratio of the 1F1B runners is, round by round and exactly, a product of two
measured factors: work (the peer's main-thread CPU seconds over tetrad's, summed over
ranks) times busy share (tetrad's 1 - cpu bubble over the peer's). With more ranks than
cores the busy share is capped by the cores, and the ratio is then the work ratio.

With pp=4 on a 2-core machine the ranks share cores: wall times and the cpu bubble
(>= 0.5 by construction) then measure contention as much as the schedule.

    .venv/bin/python benchmarks/pp.py            # pp 2 and 4, prints JSON (5-8 minutes)
    .venv/bin/python benchmarks/pp.py --timelines docs/img   # + docs/img/pp4-{1f1b,zb-h1}.png
    .venv/bin/python benchmarks/pp.py --phases schedules --rounds 24   # phase 1 alone
    .venv/bin/python benchmarks/pp.py --pp 2 --phases schedules --shapes small \
        --runners tetrad-1f1b,torch-1f1b --single --rounds 10   # small microbatches
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import harness
from tetrad.config import Config
from tetrad.layout import Layout
from tetrad.models.flops import llama_layer_costs
from tetrad.models.init import materialize
from tetrad.models.llama import Llama, cross_entropy_sum
from tetrad.models.llama_spec import LLAMA
from tetrad.parallel.activation_meter import ActivationMeter
from tetrad.parallel.pipeline.measure import measure_step, plot_pair
from tetrad.parallel.pipeline.partition import even_split, stage_costs
from tetrad.parallel.pipeline.simulate import Costs, simulate_schedule
from tetrad.parallel.pipeline.split_costs import measure_item_costs
from tetrad.parallel.pipeline.stage import layer_split, rank_chunks
from tetrad.testing import spawn
from tetrad.train.optim import lr_at, set_lr

MODEL = {"layers": 8, "dim": 256, "heads": 8, "kv_heads": 4, "vocab": 8192}
SMALL = {"layers": 8, "dim": 128, "heads": 4, "kv_heads": 2, "vocab": 2048}
SHAPES = {"base": (MODEL, 8), "small": (SMALL, 16)}  # (model, sequences of 128 per step)
BIG_VOCAB = 32000  # the split phase: the head then costs several layers
MICROBATCHES = 8
BUBBLE_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "zb-v": 2}
PHASES = ("schedules", "bubbles", "splits")
TOLERANCE = 0.15  # relative: measured bubble against the simulated one


def split_of(cfg) -> list[int]:
    """Layers per stage as the runtime splits `cfg`."""
    return layer_split(Layout.build(cfg), cfg.model)


def bench_config(
    pp: int,
    schedule: str = "1f1b",
    split: str = "",
    vocab: int | None = None,
    shape: str = "base",
    v: int = 1,
    microbatches: int = MICROBATCHES,
) -> Config:
    """The benchmark job: synthetic data, pp = world, full logits (the peer's loss)."""
    model, batch = SHAPES[shape]
    p = {"pp": pp, "pp_schedule": schedule, "microbatches": microbatches, "pp_split": split}
    p["virtual_stages"] = v
    cfg = harness.job(model | {"vocab": vocab or model["vocab"]}, p, 10**6, batch, "synthetic")
    cfg.train.loss_chunk = 0
    return cfg


class TetradRunner:
    """tetrad's Trainer; after each step, its timeline (a collective) and memory."""

    def __init__(self, cfg: Config, rank: int):
        self.cfg = cfg
        self.trainer, self.train_step = harness.tetrad_trainer(cfg, rank, pp=cfg.parallel.pp)
        self.timeline = None

    def after_step(self) -> dict[str, float]:
        """Measured and simulated bubble of the step just run, and peak activations."""
        state = self.trainer.engine.last_run  # the runtime's record of its last step
        p, t = self.cfg.parallel, self.trainer
        measured, simulated = measure_step(
            state.events, t.comm, t.mesh["pp"], p.pp_schedule, p.microbatches, p.virtual_stages
        )
        self.timeline = (measured, simulated)
        costs = simulated.meta["costs"]
        return {
            "bubble_timeline": measured.bubble_fraction,
            "bubble_simulated": simulated.meta["bubble_without_overhead"],
            "bubble_simulated_overhead": simulated.bubble_fraction,
            "bubble_replayed": simulated.meta["bubble_replayed"],
            "overhead_s": costs["overhead"],
            "p2p_s": costs["p2p"],
            "act_bytes": float(state.peak_activation_bytes),
        }


class _Span(nn.Module):
    """One stage (chunk) of tetrad's Llama as a plain module, for PipelineStage. It
    registers only the chunk's own modules: a stage's parameters are its weights (a rank
    holding two stages must not see the other's as this one's)."""

    def __init__(self, model: Llama, layers: tuple[str, ...], first: bool, last: bool):
        super().__init__()
        object.__setattr__(self, "model", model)  # called, not registered
        self.layers, self.first, self.last = list(layers), first, last
        self.blocks = nn.ModuleList(model.layers[name] for name in layers)
        ends = [model.tok_embeddings] if first else []
        self.ends = nn.ModuleList(ends + ([model.norm, model.output] if last else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_span(x, self.layers, self.first, self.last)


# the torch schedule of each peer runner: (class name, stages per rank)
PEER_SCHEDULES = {
    "1f1b": ("Schedule1F1B", 1),
    "zb": ("ScheduleInterleavedZeroBubble", 1),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipev": ("ScheduleDualPipeV", 2),
}


# (tetrad runner, the torch runner it is compared with)
PAIRS = (("tetrad-1f1b", "torch-1f1b"), ("tetrad-zb-h1", "torch-zb"),
         ("tetrad-zb-v", "torch-zbv"), ("tetrad-zb-v", "torch-dualpipev"))  # fmt: skip


class PeerRunner:
    """The same step with torch.distributed.pipelining on the same stage split: torch's
    schedule `kind` (a PEER_SCHEDULES key) over tetrad's stages of `cfg` (whose schedule
    places them: one per rank, or zb-v's V of two per rank, torch's V placement too)."""

    def __init__(self, cfg: Config, rank: int, world: int, kind: str):
        from torch.distributed import pipelining

        self.rank, self.world = rank, world
        with torch.device("meta"):
            model = Llama(cfg.model)
        chunks = rank_chunks(Layout.build(cfg), cfg.model, rank)
        name, per_rank = PEER_SCHEDULES[kind]
        if len(chunks) != per_rank:
            raise ValueError(f"{name} runs {per_rank} stages per rank, cfg gives {len(chunks)}")
        layers = [name for c in chunks for name in c.layers]
        LLAMA.prune(model, layers, chunks[0].first, chunks[-1].last)
        materialize(model, cfg.model, cfg.train.seed, "cpu")  # tetrad's exact initial weights
        self.model, self.meter, self.steps = model, ActivationMeter(), 0
        self.ends = (chunks[0].first, chunks[-1].last)  # this rank feeds inputs / targets
        stages = []
        for c in chunks:
            span = _Span(model, c.layers, c.first, c.last)
            span.forward = self._metered(span.forward)
            n = world * per_rank
            stages.append(pipelining.PipelineStage(span, c.stage, n, torch.device("cpu")))
        # tetrad's loss semantics: every microbatch's token-loss sum over the step's token
        # count, so the microbatch losses add up to the global token mean (no rescaling)
        self.denom = 1.0
        loss = self._metered(lambda out, targets: cross_entropy_sum(out, targets) / self.denom)
        m = cfg.parallel.microbatches
        schedule = getattr(pipelining, name)
        single = kind == "1f1b"  # Schedule1F1B takes one stage, the others a list
        self.schedule = schedule(stages[0] if single else stages, m, loss_fn=loss,
                                 scale_grads=False)  # fmt: skip
        self.optimizer = harness.PeerOptimizer(model, cfg.train, plain_sharded=True)
        self.loader = harness.peer_loader(cfg)

    def _metered(self, fn):
        """`fn` with the meter's hooks in the warm-up step only, as tetrad's runtime
        meters its first step only: torch's users run no meter, so the timed steps do not
        pay its hooks."""

        def run(*args):
            if self.steps:
                return fn(*args)
            with self.meter.saving():
                return fn(*args)

        return run

    def train_step(self) -> float:
        """One optimizer step; returns the mean token loss (the last rank computes it)."""
        (batch,) = self.loader.next()
        self.denom = float((batch.targets != -100).sum())
        if not self.steps:
            self.meter.reset(self.model.parameters())
        losses: list[torch.Tensor] = []
        first, last = self.ends
        inputs = (batch.inputs,) if first else ()
        if last:
            self.schedule.step(*inputs, target=batch.targets, losses=losses)
        else:
            self.schedule.step(*inputs)
        own = torch.stack(losses).sum() if losses else torch.zeros(())
        return self.optimizer.step(own)

    def after_step(self) -> dict[str, float]:
        """The warm-up step's peak activations, every step (same shapes, same schedule)."""
        self.steps += 1
        return {"act_bytes": float(self.meter.peak)}


class TetradSingle:
    """tetrad's Trainer as one process (pp = 1, the whole batch in one microbatch), the
    baseline of the issue's speed-up: every rank runs its own copy at the same time (a
    world of one, no collective), one core each, as the pipeline's ranks have."""

    def __init__(self, cfg: Config):
        self.trainer, self.train_step = harness.tetrad_trainer(cfg, 0)

    def after_step(self) -> dict[str, float]:
        return {}


class TorchSingle:
    """torch's single process at the same shape, as its users run it: tetrad's model on
    the whole batch in one forward and backward, global-norm clipping (foreach) and fused
    AdamW in tetrad's groups, tetrad's LR schedule; no process group (every rank runs its
    own copy, as `TetradSingle`)."""

    def __init__(self, cfg: Config):
        self.model, self.train = harness.peer_model(cfg), cfg.train
        self.optimizer = harness.peer_adamw(list(self.model.named_parameters()), cfg.train)
        self.loader, self.count = harness.peer_loader(cfg), 0

    def train_step(self) -> float:
        (batch,) = self.loader.next()
        denom = float((batch.targets != -100).sum())
        loss = cross_entropy_sum(self.model(batch.inputs), batch.targets) / denom
        loss.backward()
        if self.train.grad_clip > 0:
            params = self.model.parameters()
            torch.nn.utils.clip_grad_norm_(params, self.train.grad_clip, foreach=True)
        set_lr(self.optimizer, lr_at(self.count, self.train))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.count += 1
        return float(loss.detach())

    def after_step(self) -> dict[str, float]:
        return {}


# phase 1's runners: the paired schedules (run by default), then each side's single process
PAIRED = ("tetrad-1f1b", "tetrad-zb-h1", "tetrad-zb-v", "torch-1f1b", "torch-zb", "torch-zbv",
          "torch-dualpipev")  # fmt: skip
SINGLES = ("tetrad-single", "torch-single")


def phase1_runners(world: int, rank: int, shape: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The runners `names` (of PAIRED and SINGLES) at `shape`, built in that order."""
    cfg = partial(bench_config, world, shape=shape)
    zbv = partial(cfg, "zb-v", v=2)
    single = partial(bench_config, 1, shape=shape, microbatches=1)
    make = {
        "tetrad-1f1b": lambda: TetradRunner(cfg("1f1b"), rank),
        "tetrad-zb-h1": lambda: TetradRunner(cfg("zb-h1"), rank),
        "tetrad-zb-v": lambda: TetradRunner(zbv(), rank),
        "torch-1f1b": lambda: PeerRunner(cfg(), rank, world, "1f1b"),
        "torch-zb": lambda: PeerRunner(cfg(), rank, world, "zb"),
        "torch-zbv": lambda: PeerRunner(zbv(), rank, world, "zbv"),
        "torch-dualpipev": lambda: PeerRunner(zbv(), rank, world, "dualpipev"),
        "tetrad-single": lambda: TetradSingle(single()),
        "torch-single": lambda: TorchSingle(single()),
    }
    return {name: make[name]() for name in names}


def _timed_step(runner) -> dict[str, Any]:
    """One step: wall time (slowest rank), main-thread CPU per rank, the runner's extras."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.thread_time()
    loss = runner.train_step()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    extras = runner.after_step()
    row = torch.tensor([wall, cpu, extras.get("act_bytes", 0.0)], dtype=torch.float64)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    table = torch.stack(rows)
    wall_max = float(table[:, 0].max())
    return {
        **extras,
        "loss": loss,
        "wall": wall_max,
        "cpu": float(table[:, 1].sum()),
        "bubble_cpu": 1.0 - float(table[:, 1].sum()) / (len(rows) * wall_max),
        "act_bytes": [int(b) for b in table[:, 2].tolist()],
    }


def worker(
    rank: int,
    world: int,
    rounds: int,
    timelines: str,
    phases: tuple[str, ...],
    shapes: tuple[str, ...] = tuple(SHAPES),
    runners: tuple[str, ...] = PAIRED,
) -> dict:
    """The phases asked for, on this rank: `runners` at `shapes`, bubbles, splits."""
    out: dict[str, Any] = {"shapes": {}, "zb_costs": {}}
    for shape in shapes if "schedules" in phases else ():
        schedules = phase1_runners(world, rank, shape, runners)
        out["shapes"][shape] = _timed_rounds(schedules, rounds)
        if timelines and rank == 0 and shape == "base":  # the last round's tetrad steps
            Path(timelines).mkdir(parents=True, exist_ok=True)
            for name in {"tetrad-1f1b", "tetrad-zb-h1"} & set(schedules):
                measured, simulated = schedules[name].timeline
                plot_pair(measured, simulated, f"{timelines}/pp{world}-{name[7:]}.png")
        if "tetrad-zb-h1" in schedules:
            out["zb_costs"][shape] = schedules["tetrad-zb-h1"].timeline[0].meta["costs"]
        del schedules
    if "bubbles" in phases:
        out["bubbles"] = _other_bubbles(world, rank, rounds)
    if "splits" in phases:
        out |= _splits(world, rank, rounds)
    return out


def _other_bubbles(world: int, rank: int, rounds: int) -> dict[str, list[dict]]:
    """Phase 2's schedules beyond phase 1's (which 1f1b and zb-h1 come from)."""
    others = {k: v for k, v in BUBBLE_SCHEDULES.items() if k not in ("1f1b", "zb-h1")}
    bubbles = {
        name: TetradRunner(bench_config(world, name, v=v), rank) for name, v in others.items()
    }
    return _timed_rounds(bubbles, rounds)


def _splits(world: int, rank: int, rounds: int) -> dict[str, Any]:
    """Phase 3: the three splits at vocabulary 32000, and the warm-up's timings."""
    out: dict[str, Any] = {}
    even = ",".join(map(str, even_split(MODEL["layers"], world)))
    splits = {
        "balanced": TetradRunner(bench_config(world, vocab=BIG_VOCAB), rank),
        "measured": TetradRunner(bench_config(world, split="measured", vocab=BIG_VOCAB), rank),
        "even": TetradRunner(bench_config(world, split=even, vocab=BIG_VOCAB), rank),
    }
    out["splits"] = _timed_rounds(splits, rounds)
    out["split_costs"] = {name: r.timeline[0].meta["costs"] for name, r in splits.items()}
    t = splits["measured"].trainer
    out["measured_split"] = ",".join(map(str, t.layout.split))
    # the warm-up's timings once more, to report them (in layers: the median layer's cost)
    mcfg = splits["measured"].cfg
    costs = measure_item_costs(
        Layout.build(mcfg), mcfg.model, mcfg.train, t.comm, t.mesh["world"], t.device
    )
    layer = statistics.median(costs[1:-1])
    out["item_costs_in_layers"] = {"embedding": costs[0] / layer, "head+loss": costs[-1] / layer}
    return out


def _timed_rounds(runners: dict, rounds: int) -> dict[str, list[dict]]:
    """Round r runs one step of each runner, the order rotated by r. Round 0 warms up
    (allocators, connections, shapes) and is dropped from the statistics, but its loss,
    from the same initial weights and batch, is kept to compare implementations."""
    return harness.alternate(
        {name: partial(_timed_step, r) for name, r in runners.items()}, rounds + 1
    )


def _entry(steps: list[dict], pp: int, tokens: int = 8 * 128) -> dict[str, Any]:
    """Medians over the timed steps of one runner."""
    entry = {
        "tokens_per_s": round(statistics.median(tokens / s["wall"] for s in steps), 1),
        "bubble_cpu": round(statistics.median(s["bubble_cpu"] for s in steps), 3),
        "cpu_s_per_step": round(statistics.median(s["cpu"] for s in steps), 4),
        "peak_act_mib_per_rank": [
            round(max(s["act_bytes"][r] for s in steps) / 2**20, 2) for r in range(pp)
        ],
    }
    for key in (
        "bubble_timeline",
        "bubble_simulated",
        "bubble_simulated_overhead",
        "bubble_replayed",
    ):
        if key in steps[0]:
            entry[key] = round(statistics.median(s[key] for s in steps), 3)
    return entry


def summarize(pp: int, ranks: list[dict], phases: tuple[str, ...]) -> dict[str, Any]:
    """One result row per pp: medians over rounds and ratios of paired rounds."""
    out: dict[str, Any] = {"pp": pp, "split": split_of(bench_config(pp))}
    r0 = ranks[0]
    if "schedules" in phases:
        out["shapes"] = {
            shape: _shape_row(pp, shape, r0["shapes"][shape], r0["zb_costs"].get(shape))
            for shape in r0["shapes"]
        }
    if "bubbles" in phases and "schedules" in phases:  # 1f1b and zb-h1 come from phase 1
        base = {n: steps[1:] for n, steps in r0["shapes"]["base"].items()}
        rows = {"1f1b": base["tetrad-1f1b"], "zb-h1": base["tetrad-zb-h1"]}
        rows |= {n: steps[1:] for n, steps in r0["bubbles"].items()}
        out["bubbles"] = {name: _bubble_row(rows[name]) for name in BUBBLE_SCHEDULES}
    if "splits" in phases:
        out["split_vocab_32000"] = _split_row(pp, r0)
    return out


def _shape_row(pp: int, shape: str, rows: dict[str, list[dict]], zb_costs: dict | None) -> dict:
    """One shape's runners: medians, step-0 losses, paired ratios with their spread."""
    model, batch = SHAPES[shape]
    out: dict[str, Any] = {"model": model, "tokens_per_step": batch * 128}
    out["split"] = split_of(bench_config(pp, shape=shape))
    # same weights, same batch: every runner's first loss, which must agree
    out["step0_loss"] = {name: steps[0]["loss"] for name, steps in rows.items()}
    rows = {name: steps[1:] for name, steps in rows.items()}
    out |= {name: _entry(steps, pp, batch * 128) for name, steps in rows.items()}
    ratios = {
        "tetrad-1f1b / torch-1f1b tokens/s": _paired(rows, "torch-1f1b", "tetrad-1f1b", "wall"),
        "tetrad-zb-h1 / torch-zb tokens/s": _paired(rows, "torch-zb", "tetrad-zb-h1", "wall"),
        "tetrad-zb-v / torch-zbv tokens/s": _paired(rows, "torch-zbv", "tetrad-zb-v", "wall"),
        "tetrad-zb-v / torch-dualpipev tokens/s": _paired(
            rows, "torch-dualpipev", "tetrad-zb-v", "wall"
        ),
        "tetrad-zb-h1 / tetrad-1f1b tokens/s": _paired(rows, "tetrad-1f1b", "tetrad-zb-h1", "wall"),
        "zb-h1 / 1f1b bubble, measured": _paired(
            rows, "tetrad-zb-h1", "tetrad-1f1b", "bubble_timeline"
        ),
        "zb-h1 / 1f1b bubble, simulated at measured costs": _paired(
            rows, "tetrad-zb-h1", "tetrad-1f1b", "bubble_simulated"
        ),
        "zb-h1 / 1f1b bubble, simulated with the learned overhead": _paired(
            rows, "tetrad-zb-h1", "tetrad-1f1b", "bubble_simulated_overhead"
        ),
    }
    # tokens/s ratio = work ratio x busy ratio, exactly, round by round: the peer's CPU
    # seconds over tetrad's (summed over ranks), and tetrad's busy share (1 - cpu bubble)
    # over the peer's; with more ranks than cores the second is capped by the cores
    for ours, peer in PAIRS:  # the work ratio of every pair (main-thread CPU, summed)
        ratios[f"{peer} / {ours} cpu s (work)"] = _paired(rows, peer, ours, "cpu")
    ratios["tetrad-1f1b / torch-1f1b busy share"] = [
        (1 - b["bubble_cpu"]) / (1 - a["bubble_cpu"])
        for a, b in zip(rows.get("torch-1f1b", []), rows.get("tetrad-1f1b", []))
    ]
    ratios |= _speedups(rows)
    ratios = {k: v for k, v in ratios.items() if v}  # the pairs that ran
    out["ratios"] = {k: round(statistics.median(v), 3) for k, v in ratios.items()}
    out["ratio_spreads"] = {k: harness.spread(v) for k, v in ratios.items()}
    if zb_costs:
        out["zb-h1 measured costs (s)"] = _round_costs(zb_costs)
    return out


def _speedups(rows: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Each side's 1F1B speed-up over its own single process, round by round, and their
    ratio (tetrad's over torch's), the measure the small-microbatch question was asked
    in; it is tetrad-1f1b / torch-1f1b tokens/s times torch's single-process step time
    over tetrad's."""
    ours = _paired(rows, "tetrad-single", "tetrad-1f1b", "wall")
    peer = _paired(rows, "torch-single", "torch-1f1b", "wall")
    if not (ours and peer):
        return {}
    return {
        "tetrad-1f1b speed-up over tetrad-single": ours,
        "torch-1f1b speed-up over torch-single": peer,
        "tetrad speed-up / torch speed-up": [a / b for a, b in zip(ours, peer)],
        "tetrad-single / torch-single tokens/s": _paired(
            rows, "torch-single", "tetrad-single", "wall"
        ),
        "torch-single / tetrad-single cpu s (work)": _paired(
            rows, "torch-single", "tetrad-single", "cpu"
        ),
    }


def _bubble_row(steps: list[dict]) -> dict[str, Any]:
    """A schedule's measured bubble against the simulator's, per step, then medians."""
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    plain = [s["bubble_timeline"] / s["bubble_simulated"] for s in steps]
    learned = [s["bubble_timeline"] / s["bubble_simulated_overhead"] for s in steps]
    replayed = [s["bubble_timeline"] / s["bubble_replayed"] for s in steps]
    ratio, replay = statistics.median(learned), statistics.median(replayed)
    return {
        "measured": round(med("bubble_timeline"), 4),
        "simulated": round(med("bubble_simulated"), 4),
        "simulated_with_overhead": round(med("bubble_simulated_overhead"), 4),
        "measured / simulated": round(statistics.median(plain), 3),
        "measured / simulated, spread": harness.spread(plain),
        "measured / simulated with overhead": round(ratio, 3),
        "measured / simulated with overhead, spread": harness.spread(learned),
        f"within {TOLERANCE:.0%}": abs(ratio - 1) <= TOLERANCE,
        "replayed": round(med("bubble_replayed"), 4),
        "measured / replayed": round(replay, 3),
        "measured / replayed, spread": harness.spread(replayed),
        f"replayed within {TOLERANCE:.0%}": abs(replay - 1) <= TOLERANCE,
        "overhead per compute (ms)": round(1e3 * med("overhead_s"), 3),
        "overhead per transfer (ms)": round(1e3 * med("p2p_s"), 3),
    }


def _split_row(pp: int, rank0: dict) -> dict[str, Any]:
    """Phase 3: the FLOP-balanced, measured and even splits at vocab 32000."""
    splits = {name: steps[1:] for name, steps in rank0["splits"].items()}
    layers = {
        "balanced": split_of(bench_config(pp, vocab=BIG_VOCAB)),
        "measured": [int(x) for x in rank0["measured_split"].split(",")],
        "even": even_split(MODEL["layers"], pp),
    }
    out: dict[str, Any] = {
        name: {"split": layers[name]}
        | _entry(splits[name], pp)
        | {"measured costs (s)": _round_costs(rank0["split_costs"][name])}
        for name in layers
    }
    for a in ("balanced", "measured"):
        gain = _paired(splits, "even", a, "wall")
        out[f"{a} / even tokens/s"] = round(statistics.median(gain), 3)
        out[f"{a} / even tokens/s, spread"] = harness.spread(gain)
    out["simulated"] = simulate_split(pp)
    out["warm-up costs, in layers"] = {
        k: round(v, 2) for k, v in rank0["item_costs_in_layers"].items()
    }
    return out


def _round_costs(costs: dict) -> dict:
    return {
        k: [round(x, 4) for x in v] if isinstance(v, list) else round(v, 5)
        for k, v in costs.items()
    }


def _paired(rows: dict[str, list[dict]], a: str, b: str, key: str) -> list[float]:
    """a's `key` over b's, round by round (each round's steps ran back to back); with the
    wall time, b's tokens/s over a's. Empty if either did not run."""
    return [sa[key] / sb[key] for sa, sb in zip(rows.get(a, []), rows.get(b, []))]


def simulate_split(pp: int) -> dict[str, Any]:
    """The simulator's 1F1B makespan for the even and the balanced split, in FLOPs-derived
    cost units (F = B = W = a third of each stage's forward+backward FLOPs)."""
    cfg = bench_config(pp, vocab=BIG_VOCAB)
    m = cfg.model
    costs = llama_layer_costs(
        m.layers, m.dim, m.hidden_dim, m.heads, m.kv_heads, m.vocab, cfg.train.seq_len
    )
    spans = {}
    for name, split in (("even", even_split(m.layers, pp)), ("balanced", split_of(cfg))):
        per_stage = [c / 3 / costs[1] for c in stage_costs(costs, split)]  # in layer-forwards
        tl = simulate_schedule("1f1b", pp, MICROBATCHES, Costs(per_stage, per_stage, per_stage))
        spans[name] = tl.makespan
    return {
        "makespan_even": round(spans["even"], 2),
        "makespan_balanced": round(spans["balanced"], 2),
        "predicted_speedup": round(spans["even"] / spans["balanced"], 3),
    }


def main() -> None:
    p = harness.arguments(__doc__, "--pp", steps=0, rounds=8)
    p.add_argument("--timelines", default="", help="write pp=4 timeline pictures under DIR")
    p.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated, of {','.join(PHASES)}"
    )
    p.add_argument(
        "--shapes",
        default="base,small",
        help=f"phase 1's, comma-separated, of {','.join(SHAPES)}",
    )
    p.add_argument(
        "--runners",
        default=",".join(PAIRED),
        help=f"phase 1's, comma-separated, of {','.join(PAIRED + SINGLES)}",
    )
    p.add_argument(
        "--single",
        action="store_true",
        help="add each side's single process to phase 1 and report the 1F1B speed-ups over it",
    )
    args = p.parse_args()
    phases, shapes = tuple(args.phases.split(",")), tuple(args.shapes.split(","))
    if not set(phases) <= set(PHASES):
        raise ValueError(f"--phases={args.phases!r}: each must be one of {PHASES}")
    if not set(shapes) <= set(SHAPES):
        raise ValueError(f"--shapes={args.shapes!r}: each must be one of {tuple(SHAPES)}")
    runners = tuple(args.runners.split(",")) + (SINGLES if args.single else ())
    if not set(runners) <= set(PAIRED + SINGLES):
        raise ValueError(f"--runners={args.runners!r}: each must be one of {PAIRED + SINGLES}")
    needs = {"base", "tetrad-1f1b", "tetrad-zb-h1"}  # the bubbles phase reuses phase 1's
    if "bubbles" in phases and not needs <= set(shapes + runners):
        raise ValueError(
            f"--phases={args.phases!r} needs phase 1's base shape with tetrad-1f1b and"
            f" tetrad-zb-h1: --shapes={args.shapes!r} --runners={args.runners!r}"
        )
    results = []
    t0 = time.perf_counter()
    for pp in args.pp:
        timelines = args.timelines if pp == max(args.pp) else ""
        ranks = spawn(worker, pp, args.rounds, timelines, phases, shapes, runners, timeout=3600)
        results.append(summarize(pp, ranks, phases))
    harness.report("pp", bench_config(2), results, microbatches=MICROBATCHES,
                   rounds=args.rounds, phases=phases, shapes=shapes, runners=runners,
                   loss="full logits on both sides (tetrad loss_chunk=0)",
                   tolerance=TOLERANCE, seconds=round(time.perf_counter() - t0, 1))  # fmt: skip


if __name__ == "__main__":
    main()
