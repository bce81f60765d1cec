"""`Layout`: one job's configuration checked against one world, built once.

Every fact the parallel code, the trainer and the planner read about how the job is laid
out lives here, derived in one place: the degrees and the world, the local shapes (a
microbatch's sequences on a data rank, the sequence a rank holds under cp and under sp),
the torch dtypes, and the pipeline's checked schedule and stage split. `Layout.build` is
the only place validation runs on the training path; it runs on every rank before the
first collective and raises a `ValueError` naming the offending values.

The pipeline schedules' and the stage split's rules are pure and live here, below every
part that applies them (the runtime, the simulator, the planner's search), so nothing
here imports upward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tetrad.config import (
    BLOCK,
    COMPRESSED,
    DTYPES,
    SCHEDULES,
    Config,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    _require,
    check_choices,
    check_sections,
)
from tetrad.mesh import AXES, ep_spans_tp  # AXES: the mesh's axes, outermost first
from tetrad.precision import wide

SPLIT_BACKWARD = ("zb-h1", "zb-v")  # backward split into B (inputs) and W (weights)
# what the Layout takes from the parallel section as it is
AS_CONFIGURED = ("microbatches", "sp", "cp_attention", "zero_stage", "reshard_after_forward")
AS_CONFIGURED += ("virtual_stages", "ep", "cp_kernel", "error_feedback", "fp8_all_gather")


class Degrees(dict):
    """Axis -> size, outermost first: a dict to read (`[axis]`, `items()`, equal to a
    plain dict) that cannot change and hashes by its items, so a `Layout` is a key."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self):
        return (Degrees, (dict(self),))

    def _frozen(self, *args, **kwargs):
        raise TypeError("a Layout's degrees cannot change: build another Layout")

    __setitem__ = __delitem__ = __ior__ = _frozen  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _frozen  # type: ignore[assignment]


@dataclass(frozen=True)
class Layout:
    """The validated layout of one job on `world` ranks (see the module docstring)."""

    degrees: Degrees  # axis -> size, outermost first (pp, dp, fsdp, cp, tp)
    microbatches: int
    microbatch_size: int  # sequences per microbatch on one data rank
    seq_len: int  # a whole sequence's tokens
    local_seq: int  # the tokens of a sequence this rank holds: seq_len / cp
    sp: bool
    cp_attention: str
    zero_stage: int
    reshard_after_forward: bool
    bucket_bytes: int
    first_bucket_bytes: int  # 0: by the device (`parallel._replicated_grads`)
    schedule: str
    virtual_stages: int
    split: tuple[int, ...] | None  # layers per global stage; None: balanced on costs
    split_measured: bool  # --pp-split measured: timed in a warm-up, then fixed
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32  # the optimizer's copy of the weights (wide)
    ep: int = 1  # expert parallelism: ranks one MoE layer's experts are sharded over
    cp_kernel: str = "fused"  # a cp core's block attention (parallel/context_kernels.py)
    loss_chunk: int = 0  # tokens the head and loss run at a time (0: all of them at once)
    fp8: str = ""  # "tensorwise", "rowwise": the blocks' linear matmuls in FP8 (models/fp8.py)
    compress: str = ""  # "int8", "fp8": gradients reduced in that block format; "": not
    error_feedback: bool = True  # a compressed reduction carries what it dropped forward
    fp8_all_gather: bool = False  # ZeRO-3 gathers the FP8 linears' weights in FP8
    compiled: bool = False  # the blocks' bodies under torch.compile (--compile)

    @property
    def reduce_bytes(self) -> float:
        """Bytes a gradient value takes on the wire: its reduce dtype's, or compressed one
        byte and its share of a block's fp32 scale."""
        return 1 + 4 / BLOCK if self.compress else self.reduce_dtype.itemsize

    @property
    def compression(self) -> tuple[str, bool]:
        """(block format, error feedback) of a compressed gradient reduction."""
        return self.compress, self.error_feedback

    def __post_init__(self) -> None:
        if not isinstance(self.degrees, Degrees):  # a plain dict given: freeze it
            object.__setattr__(self, "degrees", Degrees(self.degrees))

    @classmethod
    def build(cls, cfg: Config, world: int | None = None) -> Layout:
        """Validate `cfg` (for `world` ranks if given) and derive its layout."""
        check_sections(cfg)
        return cls.of(cfg.model, cfg.train, cfg.parallel, world)

    @classmethod
    def of(
        cls,
        model: ModelConfig,
        train: TrainConfig,
        parallel: ParallelConfig,
        world: int | None = None,
    ) -> Layout:
        """The layout of these three sections (for `world` ranks if given), its own rules
        checked; the sections' own checks are `config.check_sections`' (`build` runs both)."""
        t, p = train, parallel
        _check_parallel(p, world)
        split = _check_split(p, model.layers)
        _check_shapes(model, t, p)
        check_ep(p.ep, model.experts, p.degrees)
        _check_fp8(model, t, p)
        window = model.sliding_window
        _require(
            not 0 < window < t.seq_len,
            f"model.sliding_window={window} < train.seq_len={t.seq_len}: a window "
            "shorter than the sequence is not implemented; train with seq_len <= the window",
        )
        return cls(
            degrees=Degrees((axis, getattr(p, axis)) for axis in AXES),
            microbatch_size=t.global_batch // (p.data_ranks * p.microbatches),
            seq_len=t.seq_len,
            local_seq=t.seq_len // p.cp,
            bucket_bytes=int(p.bucket_mb * 2**20),
            first_bucket_bytes=int(p.first_bucket_mb * 2**20),
            schedule=p.pp_schedule,
            split=split,
            split_measured=p.pp_split == "measured",
            compute_dtype=DTYPES[t.dtype],
            reduce_dtype=_reduce_dtype(t.dtype, p.reduce_dtype),
            master_dtype=wide(DTYPES[t.dtype]),
            loss_chunk=t.loss_chunk,
            fp8=t.fp8,
            compress=p.reduce_dtype if p.reduce_dtype in COMPRESSED else "",
            compiled=t.compile,
            **{name: getattr(p, name) for name in AS_CONFIGURED},
        )

    @property
    def world(self) -> int:
        return math.prod(self.degrees.values())

    # each axis's degree by its name: `layout.tp` is `degrees["tp"]`
    pp, dp, fsdp, cp, tp = (
        property(lambda self, a=a: self.degrees[a]) for a in ("pp", "dp", "fsdp", "cp", "tp")
    )

    @property
    def data_ranks(self) -> int:
        """Ranks that read different sequences (cp ranks share theirs)."""
        return self.degrees["dp"] * self.degrees["fsdp"]

    @property
    def data(self) -> int:
        """Ranks of a stage that hold the same weights' tp slice: dp·fsdp·cp."""
        return self.data_ranks * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over every data rank."""
        return self.microbatch_size * self.microbatches * self.data_ranks

    @property
    def dtype_name(self) -> str:
        """The compute dtype's name (`config.DTYPES`' key: "bf16", "fp32", "fp64")."""
        return dtype_name(self.compute_dtype)

    @property
    def element_bytes(self) -> int:
        """Bytes of one element in the compute dtype."""
        return self.compute_dtype.itemsize

    @property
    def ep_spans_tp(self) -> bool:
        """Whether an ep group takes whole tp groups (the data ranks alone are too few:
        `mesh.expert_groups`)."""
        return ep_spans_tp(self.data, self.ep)

    @property
    def expert_data(self) -> int:
        """Ranks of a stage holding the same experts' slice (the expert-data group):
        dp·fsdp·cp·tp / ep."""
        return self.data * self.tp // self.ep

    def kv_heads(self, kv_heads: int) -> int:
        """Key/value heads one tp rank holds of a model's `kv_heads` (a head shared by
        several ranks when tp exceeds them)."""
        return max(kv_heads // self.tp, 1)

    @property
    def stages(self) -> int:
        """Global pipeline stages: pp ranks times the stages each holds."""
        return self.pp * self.virtual_stages

    @property
    def act_seq(self) -> int:
        """The tokens of a sequence one rank's activations hold between blocks: under sp
        the tp ranks split this rank's share again."""
        return self.local_seq // self.tp if self.sp else self.local_seq

    @property
    def microbatch_tokens(self) -> int:
        """Tokens of one microbatch this rank computes: sequences x its share of each."""
        return self.microbatch_size * self.local_seq

    def with_split(self, split: Sequence[int]) -> Layout:
        """This layout with the stage split fixed (a measured split, once agreed)."""
        check_split(split, None, self.stages)
        return dataclasses.replace(self, split=tuple(split), split_measured=False)


def dtype_name(dtype: torch.dtype) -> str:
    """`dtype`'s name in the configuration (`config.DTYPES`' key: "bf16", "fp32", "fp64")."""
    return _DTYPE_NAMES[dtype]


_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


# --- elastic shrink: the one degree that follows the world -----------------------------

ELASTIC_AXES = ("dp", "fsdp")


def elastic_config(cfg: Config, world: int) -> Config:
    """`cfg` for a world of `world` ranks: its elastic degree (`parallel.elastic`, "dp" or
    "fsdp") is the world over the product of the other degrees, which are fixed, and the
    global batch is kept by changing the number of microbatches: their size stays the one
    at `elastic_max_world` ranks (`microbatches` is the count there), so a smaller world
    accumulates more of them per rank. Without an elastic degree, `cfg` itself.

    Raises ValueError naming the values when `world` is below the fixed degrees' product
    (the layout's minimum), is not a multiple of it, or the global batch does not split."""
    p = cfg.parallel
    if not p.elastic:
        return cfg
    _require(p.elastic in ELASTIC_AXES, f"parallel.elastic={p.elastic!r} is not one of "
             f"{ELASTIC_AXES} (or \"\": no elastic degree)")  # fmt: skip
    fixed = {axis: n for axis, n in p.degrees.items() if axis != p.elastic}
    _require(min(fixed.values()) >= 1, f"parallel degrees {fixed} must be >= 1")
    minimum = math.prod(fixed.values())
    if world < minimum or world % minimum:
        why = (
            "fewer than the layout's minimum" if world < minimum else f"not a multiple of {minimum}"
        )
        raise ValueError(f"{world} ranks cannot hold the fixed degrees {_product(fixed)} = "
                         f"{minimum} with --{p.elastic} auto: {why}")  # fmt: skip
    top = p.elastic_max_world or world  # the largest world: its microbatch size is kept
    _require(top >= world and top % minimum == 0, f"parallel.elastic_max_world={top} must be "
             f"a multiple of {minimum} and >= the world ({world})")  # fmt: skip
    other = p.fsdp if p.elastic == "dp" else p.dp  # the data axis that is fixed
    gb, m, most = cfg.train.global_batch, p.microbatches, top // minimum * other
    size = gb // (most * m) if m >= 1 and gb % (most * m) == 0 else 0
    _require(size >= 1, f"global_batch={gb} does not split into microbatches={m} on each of "
             f"{most} data ranks (the largest world, {top} ranks)")  # fmt: skip
    data = world // minimum * other
    _require(gb % (data * size) == 0, f"at {world} ranks the global batch {gb} does not split "
             f"over {data} data ranks in microbatches of {size} sequences (their size at {top} "
             "ranks)")  # fmt: skip
    count = {p.elastic: world // minimum, "microbatches": gb // (data * size)}
    parallel = dataclasses.replace(p, **count)
    return dataclasses.replace(cfg, parallel=parallel)


def fixed_layout(parallel: dict) -> dict:
    """A config's parallel section (as a dict) less what an elastic restart changes (the
    elastic degree and the microbatch count): equal for states one run may resume from."""
    axis = parallel.get("elastic") or ""
    return {k: v for k, v in parallel.items() if k not in (axis, "microbatches") or not axis}


def _product(degrees: dict[str, int]) -> str:
    return "*".join(f"{axis}={n}" for axis, n in degrees.items() if n > 1) or "1"


# --- the rules, pure --------------------------------------------------------------------


def check_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError naming the values if schedule `name` cannot run this request."""
    _require(name in SCHEDULES, f"unknown pipeline schedule {name!r}; expected one of {SCHEDULES}")
    _require(pp >= 1, f"pp must be >= 1, got pp={pp}")
    _require(microbatches >= 1, f"microbatches must be >= 1, got microbatches={microbatches}")
    v = virtual_stages
    if name == "interleaved-1f1b":
        _require(v >= 2, f"interleaved-1f1b needs virtual_stages >= 2, got {v}")
        _require(
            microbatches % pp == 0,
            f"interleaved-1f1b needs microbatches % pp == 0, got microbatches={microbatches},"
            f" pp={pp}",
        )
    elif name == "zb-v":
        _require(v == 2, f"zb-v holds exactly 2 stages per rank: virtual_stages=2, got {v}")
    else:
        _require(v == 1, f"{name} runs one stage per rank: virtual_stages must be 1, got {v}")


def parse_split(text: str, n_layers: int | None = None, stages: int | None = None) -> list[int]:
    """Parse an explicit split such as "4,4,3,3" (layers per stage) and check it."""
    try:
        split = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"pipeline split {text!r} must be comma-separated integers") from None
    check_split(split, n_layers, stages)
    return split


def check_split(split: Sequence[int], n_layers: int | None, stages: int | None) -> None:
    """Raise ValueError unless `split` is a valid layers-per-stage list: the embedding sits
    on the first stage and the head on the last, so only a middle stage needs a layer."""
    if not split or any(n < 0 for n in split):
        raise ValueError(f"pipeline split {list(split)} needs non-negative layer counts")
    if any(n < 1 for n in split[1:-1]):
        raise ValueError(f"pipeline split {list(split)}: a middle stage holds no layer")
    if stages is not None and len(split) != stages:
        raise ValueError(f"pipeline split {list(split)} has {len(split)} stages, not {stages}")
    if n_layers is not None and sum(split) != n_layers:
        raise ValueError(f"pipeline split {list(split)} sums to {sum(split)}, not {n_layers}")


def ep_fits(ep: int, data: int, tp: int) -> bool:
    """Whether an ep group of `ep` ranks can be taken from a stage's `data` data ranks
    (dp*fsdp*cp), or from whole groups of its `tp` tensor ranks over some of them."""
    return data % ep == 0 or (ep % tp == 0 and data % (ep // tp) == 0)


def check_ep(ep: int, experts: int, degrees: dict[str, int]) -> None:
    """Raise ValueError naming the values unless `ep` ranks can share `experts` experts.

    The ep group borrows ranks inside one pipeline stage: the data ranks first (fsdp, then
    dp, then cp: `mesh.expert_groups`), and the tensor ranks only when those are not
    enough; then it takes whole tp groups, so ep must be a multiple of tp."""
    _require(ep >= 1, f"parallel.ep must be >= 1, got {ep}")
    if ep == 1:
        return
    _require(experts > 0, f"parallel.ep={ep} needs a mixture-of-experts model (model.experts > 0)")
    _require(experts % ep == 0, f"model.experts={experts} is not divisible by parallel.ep={ep}")
    data, tp = degrees["dp"] * degrees["fsdp"] * degrees["cp"], degrees["tp"]
    _require(
        ep_fits(ep, data, tp),
        f"parallel.ep={ep} must divide the data ranks dp*fsdp*cp={data}, or be a multiple of"
        f" tp={tp} dividing dp*fsdp*cp*tp={data * tp}",
    )


def _check_fp8(model: ModelConfig, t: TrainConfig, p: ParallelConfig) -> None:
    """FP8 scales are the single process's where a layout splits a microbatch's tokens (cp,
    sp) or a weight (tp): each is the max over the ranks splitting it (models/fp8.py). A kv
    head shared by tp ranks, the split backward's deferred weight gradients and an FP8
    gather of tp shards are refused. The FP8 all-gather is ZeRO-3's, of tensorwise weights
    (parallel/compress.py)."""
    if p.fp8_all_gather:
        _require(
            t.fp8 == "tensorwise" and p.zero_stage == 3 and p.fsdp > 1,
            f"parallel.fp8_all_gather with train.fp8={t.fp8!r}, zero_stage={p.zero_stage}, "
            f"fsdp={p.fsdp}: it gathers ZeRO-3's shards (fsdp > 1) of tensorwise FP8 weights; "
            "rowwise scales its input gradient's weight per input feature, which an FP8 copy "
            "scaled per output row cannot give",
        )
        _require(
            p.tp == 1,
            f"parallel.fp8_all_gather with parallel.tp={p.tp}: a tp shard's FP8 scale would "
            "need its amax's max over tp as well as fsdp, which is not implemented",
        )
    if not t.fp8:
        return
    _require(
        p.tp <= model.kv_heads,
        f"train.fp8={t.fp8!r} with parallel.tp={p.tp} > model.kv_heads={model.kv_heads}: "
        "the tp ranks sharing a kv head each hold a partial gradient of it, which FP8 "
        "cannot quantize as the single process quantizes their sum",
    )
    _require(
        p.pp_schedule not in SPLIT_BACKWARD or p.pp == 1,
        f"train.fp8={t.fp8!r} with pp_schedule={p.pp_schedule!r}: the split backward's deferred"
        " weight gradients are not implemented for FP8 linears yet",
    )


def _reduce_dtype(dtype: str, reduce_dtype: str) -> torch.dtype:
    """Gradients cross ranks in `parallel.reduce_dtype`, or in float64 under fp64 compute,
    where every part is float64 (tetrad.precision); fp64 with bf16 reductions is refused."""
    if dtype != "fp64":  # compressed: summed in fp32
        return DTYPES.get(reduce_dtype, torch.float32)
    _require(
        reduce_dtype == "fp32",
        f"dtype='fp64' reduces in float64; reduce_dtype={reduce_dtype!r} would"
        " round its gradients: leave reduce_dtype at its default",
    )
    return torch.float64


def _check_parallel(p: ParallelConfig, world: int | None) -> None:
    for name in ("dp", "fsdp", "tp", "pp", "cp", "microbatches", "virtual_stages"):
        _require(getattr(p, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    if world is not None:
        _require(
            p.world == world,
            f"world size {world} != dp*fsdp*cp*tp*pp = {p.dp}*{p.fsdp}*{p.cp}*{p.tp}*{p.pp}"
            f" = {p.world}",
        )
    _require(
        p.reduce_dtype != "fp64", "reduce_dtype='fp64' is fp64 compute's alone: use dtype='fp64'"
    )
    check_choices("parallel", p)  # zero_stage, cp_attention, cp_kernel, reduce_dtype, pp_schedule
    _require(p.bucket_mb > 0, f"bucket_mb must be > 0, got {p.bucket_mb}")
    _require(p.first_bucket_mb >= 0, f"first_bucket_mb must be >= 0, got {p.first_bucket_mb}")
    _require(not p.sp or p.tp > 1, "sp=True needs tp > 1 (sequence parallelism splits over tp)")
    if p.pp > 1 or p.virtual_stages > 1:
        check_schedule(p.pp_schedule, p.pp, p.microbatches, p.virtual_stages)


def _check_split(p: ParallelConfig, layers: int) -> tuple[int, ...] | None:
    """pp_split: "" (balanced on the model's costs), "measured" (balanced on costs timed
    in a warm-up) or layer counts per stage such as "5,3" (checked against layers and
    stages); the counts, or None when they are still to be balanced."""
    if p.pp_split in ("", "measured"):
        return None
    stages = p.pp * p.virtual_stages
    try:  # one stage takes every layer whatever the counts say
        split = parse_split(p.pp_split, *((layers, stages) if stages > 1 else (None, None)))
    except ValueError as e:
        raise ValueError(
            f"pp_split={p.pp_split!r} is not '', 'measured' or layer counts per stage "
            f"(model.layers={layers}, pp*virtual_stages={stages}): {e}"
        ) from None
    return tuple(split) if stages > 1 else None


def _check_shapes(model: ModelConfig, t: TrainConfig, p: ParallelConfig) -> None:
    per = p.data_ranks * p.microbatches
    _require(
        t.global_batch % per == 0,
        f"global_batch={t.global_batch} is not divisible by data ranks (dp*fsdp={p.data_ranks})"
        f" x microbatches={p.microbatches} = {per}",
    )
    _check_tp(model, p.tp)
    if p.cp > 1:  # 2·cp chunks per sequence, rank r holding chunks r and 2·cp-1-r
        _require(
            t.seq_len % (2 * p.cp) == 0,
            f"cp={p.cp} splits every sequence into 2*cp={2 * p.cp} equal chunks: seq_len="
            f"{t.seq_len} is not divisible by {2 * p.cp}",
        )
    if p.sp:  # sp splits the sequence share this rank holds (all of it without cp)
        _require(
            (t.seq_len // p.cp) % p.tp == 0,
            f"sp needs seq_len/cp divisible by tp: seq_len={t.seq_len}, tp={p.tp}, cp={p.cp}",
        )
    stages = p.pp * p.virtual_stages  # the first and the last may hold no layer: the
    _require(  # embedding alone, the final norm and head alone (Megatron's account for them)
        model.layers >= stages - 2 if stages > 1 else model.layers >= 1,
        f"model.layers={model.layers} < pp*virtual_stages-2={p.pp}*{p.virtual_stages}-2"
        f" = {stages - 2}: every stage but the first and the last needs a layer",
    )


def _check_tp(m: ModelConfig, tp: int) -> None:
    _require(m.heads % tp == 0, f"model.heads={m.heads} is not divisible by tp={tp}")
    _require(
        m.kv_heads % tp == 0 or tp % m.kv_heads == 0,
        f"model.kv_heads={m.kv_heads} and tp={tp}: one must divide the other",
    )
    _require(m.dim % tp == 0, f"model.dim={m.dim} is not divisible by tp={tp}")
    _require(m.hidden_dim % tp == 0, f"ffn hidden size {m.hidden_dim} is not divisible by tp={tp}")
