"""Typed configuration: dataclasses per component, TOML loading, CLI overrides, validation.

Every rank checks the whole configuration before the first collective (`Layout.build`
runs these section checks and the layout's own), so a bad value fails the same way
everywhere with a `ValueError` that names it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

# compute and reduction dtypes by name: the one table every part reads (fp64 verifies:
# every part in float64, tetrad.precision)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
# pipeline schedules (parallel/pipeline/schedules.py builds each one's action lists)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
# gradient reductions in a block-scaled byte format, summed in fp32 (parallel/compress.py):
# a byte a value, and an fp32 scale a block of BLOCK values
COMPRESSED = ("int8", "fp8")
BLOCK = 256
# activation recomputation: nothing, the cheap and large parts, or whole blocks
RECOMPUTE = ("none", "selective", "full")
# context parallelism's attention: keys and values all-gathered, or passed around a ring
CP_ATTENTION = ("allgather", "ring")
# how a cp core attends one block: torch's fused kernel where it has one, or plain matmuls
CP_KERNELS = ("fused", "unfused")
# mixture of experts: how router scores become weights, and how experts' load is balanced
ROUTERS = ("softmax", "sigmoid")
BALANCE = ("aux", "bias", "none")


def option(
    default: Any,
    help: str,
    flag: str = "",
    choices: tuple[Any, ...] = (),
    metavar: str | None = None,
) -> Any:
    """A field with its `default` that is also an option of `tetrad train` (cli.py builds
    the parser from its "cli" metadata): its help; its flag, where not the field's name (a
    bool field's flag sets the opposite of its default: `--no-progress` for `progress =
    True`); its choices or metavar. Every option is also settable in a --config TOML file."""
    cli = {"help": help, "flag": flag, "choices": choices, "metavar": metavar}
    return field(default=default, metadata={"cli": cli})


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder. `ffn_dim=0` derives it Llama-style from `dim`.
    `family` names the model family (models/families.py) whose ModelSpec parallel code reads."""

    name: str = "small"
    family: str = "llama"
    layers: int = option(4, "transformer blocks")
    dim: int = option(128, "model width (the residual stream's size)")
    heads: int = option(4, "attention heads")
    kv_heads: int = option(2, "key/value heads (grouped-query attention)")
    vocab: int = option(
        256,
        "vocabulary size (default: with a tokenizer or a token file, its vocabulary padded "
        "to a multiple of 128*tp; else 256)",
    )
    ffn_dim: int = 0
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = option(False, "share the token embedding's weights with the output head")
    init_std: float = 0.02
    init_from_hf: str = option(
        "",
        "start from a local Hugging Face Llama directory (config.json + safetensors): "
        "the model's shape and weights; shape flags that contradict config.json are errors",
        metavar="DIR",
    )
    head_size: int = 0  # channels per attention head; 0: dim // heads (Qwen3 sets its own)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys before rotary (Qwen3)
    qkv_bias: bool = option(False, "biases on the query, key and value projections (Qwen2)")
    sliding_window: int = option(
        0,
        "attend to the last N positions only (Mistral); 0: none. A window shorter than "
        "--seq-len is refused (docs/models.md)",
        metavar="N",
    )
    # mixture of experts (family "moe"; docs/moe.md): from layer `dense_layers` on, the
    # feed-forward is a router over `experts` SwiGLU experts of `moe_ffn_dim`, each token
    # sent to `top_k` of them, plus `shared_experts` every token uses
    experts: int = option(
        0,
        "routed experts per MoE layer (docs/moe.md); > 0 on a dense model makes it a "
        "mixture of experts, 0 makes an MoE preset dense",
    )
    top_k: int = option(2, "experts each token is sent to")
    moe_ffn_dim: int = option(  # 0: hidden_dim
        0, "one expert's SwiGLU inner size (default: the dense ffn size)"
    )
    shared_experts: int = option(0, "experts every token runs through, beside its top-k")
    dense_layers: int = option(0, "the first N layers keep a dense feed-forward")
    router: str = option(
        "softmax",
        "softmax: top-k of the softmax, renormalised (Mixtral, Qwen3); sigmoid: sigmoid "
        "scores, top-k normalised (DeepSeek-V3)",
        choices=ROUTERS,
    )
    balance: str = option(
        "aux",
        "load balance: aux (sequence-wise auxiliary loss), bias (DeepSeek-V3's loss-free "
        "per-expert bias) or none",
        choices=BALANCE,
    )
    aux_loss_coef: float = option(0.01, "the auxiliary loss's coefficient (default 0.01)")
    bias_rate: float = 0.001  # the loss-free bias's step per training step
    capacity_factor: float = 0.0  # 0: dropless (every token reaches its top_k experts)
    # DeepSeek-V3's routing (docs/models.md): experts in n_group groups, each token's top_k
    # chosen within its topk_group best groups; the chosen weights renormalised when
    # norm_topk_prob, then times routed_scaling
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    norm_topk_prob: bool = True
    # multi-head latent attention (family "deepseek_v3"): queries through a rank-q_lora_rank
    # bottleneck (0: one projection), keys and values from a rank-kv_lora_rank latent; each
    # head's query and key are qk_nope_dim channels without position and qk_rope_dim rotated
    # ones (the key's shared by all heads), its value v_head_dim
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.heads

    @property
    def expert_dim(self) -> int:
        """One expert's SwiGLU inner size."""
        return self.moe_ffn_dim or self.hidden_dim

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU inner size: 2/3 of 4·dim rounded up to a multiple of 32, unless given."""
        return self.ffn_dim or 32 * -(-(8 * self.dim // 3) // 32)


# what presets of a family share: the tiny shape (each tiny variant adds its family's
# features); Llama 3's vocabulary, context and rotary; Qwen3's (dense, and its mixtures)
TINY = dict(layers=2, dim=32, heads=4, kv_heads=2, vocab=256)
LLAMA3 = dict(kv_heads=8, vocab=128256, max_seq_len=8192, rope_theta=500000.0)
QWEN3 = dict(
    family="qwen3",
    head_size=128,
    vocab=151936,
    max_seq_len=40960,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=True,
)
QWEN3_MOE = dict(QWEN3, family="moe", experts=128, top_k=8)
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": TINY,
    "small": dict(layers=4, dim=128, heads=4, kv_heads=2, vocab=256),
    "base": dict(layers=8, dim=256, heads=8, kv_heads=4, vocab=256),
    "llama3-8b": dict(LLAMA3, layers=32, dim=4096, heads=32, ffn_dim=14336),
    "llama3-70b": dict(LLAMA3, layers=80, dim=8192, heads=64, ffn_dim=28672),
    "llama3-405b": dict(LLAMA3, layers=126, dim=16384, heads=128, ffn_dim=53248),
    # Llama's decoder under other names (docs/models.md): Qwen3 with QK-norm and its own
    # head size, Qwen2/2.5 with q/k/v biases, Mistral (v0.3: no sliding window)
    "qwen3-tiny": dict(TINY, family="qwen3", head_size=16, qk_norm=True, norm_eps=1e-6),
    "qwen3-8b": dict(QWEN3, layers=36, dim=4096, heads=32, kv_heads=8, ffn_dim=12288),
    "qwen3-32b": dict(QWEN3, layers=64, dim=5120, heads=64, kv_heads=8, ffn_dim=25600),
    "qwen2-tiny": dict(TINY, family="qwen2", qkv_bias=True, norm_eps=1e-6),
    "qwen2.5-7b": dict(
        family="qwen2", layers=28, dim=3584, heads=28, kv_heads=4, vocab=152064,
        ffn_dim=18944, max_seq_len=131072, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True,
    ),
    "mistral-tiny": dict(TINY, family="mistral", sliding_window=128),
    "mistral-7b": dict(
        family="mistral", layers=32, dim=4096, heads=32, kv_heads=8, vocab=32768,
        ffn_dim=14336, max_seq_len=32768, rope_theta=1e6,
    ),
    # mixtures of experts: the first two train here, the rest are for the planner
    "moe-tiny": dict(TINY, family="moe", experts=4, top_k=2, moe_ffn_dim=32, shared_experts=1),
    "moe-small": dict(
        family="moe", layers=4, dim=128, heads=4, kv_heads=2, vocab=256,
        experts=8, top_k=2, moe_ffn_dim=128, shared_experts=1, dense_layers=1,
    ),
    "mixtral-8x7b": dict(
        family="moe", layers=32, dim=4096, heads=32, kv_heads=8, vocab=32000,
        experts=8, top_k=2, moe_ffn_dim=14336, max_seq_len=32768, rope_theta=1e6,
    ),
    "qwen3-30b-a3b": dict(QWEN3_MOE, layers=48, dim=2048, heads=32, kv_heads=4, moe_ffn_dim=768),
    "qwen3-235b-a22b": dict(QWEN3_MOE, layers=94, dim=4096, heads=64, kv_heads=4, moe_ffn_dim=1536),
    # DeepSeek-V3: multi-head latent attention, 3 dense layers, then 256 routed experts in
    # 8 groups (top 8 within the best 4 groups) and one shared; its 4096 positions before
    # yarn (the 128K context is yarn's, not implemented); the tiny one trains here
    "deepseek-tiny": dict(
        family="deepseek_v3", layers=3, dim=32, heads=4, kv_heads=4, vocab=256, ffn_dim=64,
        norm_eps=1e-6, experts=8, top_k=2, moe_ffn_dim=16, shared_experts=1, dense_layers=1,
        router="sigmoid", balance="bias", n_group=4, topk_group=2, routed_scaling=2.5,
        q_lora_rank=16, kv_lora_rank=12, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=8,
    ),
    "deepseek-v3": dict(
        family="deepseek_v3", layers=61, dim=7168, heads=128, kv_heads=128, vocab=129280,
        ffn_dim=18432, max_seq_len=4096, norm_eps=1e-6, experts=256, top_k=8,
        moe_ffn_dim=2048, shared_experts=1, dense_layers=3, router="sigmoid", balance="bias",
        n_group=8, topk_group=4, routed_scaling=2.5, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
    ),
}  # fmt: skip


def model_preset(name: str) -> ModelConfig:
    """A named model shape; the planner uses the large ones, tests the tiny one."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODEL_PRESETS)}")
    return ModelConfig(name=name, **MODEL_PRESETS[name])


@dataclass
class ParallelConfig:
    """Degrees of the five axes and how each axis behaves."""

    # dp and fsdp (layout.ELASTIC_AXES) also take "auto" on the command line
    dp: int = option(
        1,
        "data-parallel degree; auto (with --nnodes MIN:MAX): the world over the other "
        "degrees at each (re)start, so that losing a node shrinks the job "
        "(docs/checkpoint.md)",
    )
    fsdp: int = option(1, "sharded data-parallel degree (ZeRO, --zero-stage); auto: as --dp auto")
    tp: int = option(1, "tensor-parallel degree (docs/tp.md)")
    pp: int = option(1, "pipeline-parallel degree (docs/pp.md)")
    cp: int = option(  # context parallelism: each sequence split over cp ranks
        1,
        "context parallelism: split every sequence over N ranks (2N load-balanced chunks; "
        "seq-len must be divisible by 2N), attention exchanging keys and values "
        "(docs/cp.md)",
        metavar="N",
    )
    cp_attention: str = option(
        "allgather",
        "how attention crosses the cp ranks: allgather (default: keys and values "
        "all-gathered) or ring (kv blocks passed around, online softmax)",
        choices=CP_ATTENTION,
    )
    cp_kernel: str = option(
        "fused",
        "how a cp core attends one block: fused (default: torch's flash or "
        "memory-efficient kernel for the device and dtype, tiled; plain matmuls where "
        "there is none) or unfused (plain fp32 matmuls holding a whole block of scores)",
        choices=CP_KERNELS,
    )
    # expert parallelism: experts sharded over ep ranks borrowed from the data (and tensor)
    # ranks; not a mesh axis of its own, so it does not enlarge the world
    ep: int = option(
        1,
        "expert parallelism (MoE models): shard each layer's experts over N ranks taken "
        "from the data ranks (and the tensor ranks where there are too few); tokens reach "
        "their experts by all-to-all (docs/moe.md). The world size is unchanged",
        metavar="N",
    )
    zero_stage: int = option(
        3,
        "what fsdp shards: 1 optimizer state, 2 also gradients, 3 also parameters "
        "(default 3; docs/fsdp.md)",
        choices=(1, 2, 3),
    )
    sp: bool = option(False, "sequence parallelism (tp>1)")
    pp_schedule: str = option(
        "1f1b", "pipeline schedule (default 1f1b; docs/pp.md)", choices=SCHEDULES
    )
    microbatches: int = option(1, "microbatches each data rank's share of a step is split into")
    virtual_stages: int = option(1, "pipeline stages per rank (interleaved-1f1b: >= 2; zb-v: 2)")
    pp_split: str = option(
        "",
        "layers per pipeline stage: balanced on analytic FLOPs (default), 'measured' "
        "(balanced on the embedding, layer and head costs timed in a short warm-up, agreed "
        "by every rank), or counts such as 5,3",
    )
    bucket_mb: float = option(25.0, "data parallelism's gradient buckets, MiB (default 25)")
    # the first (earliest-ready) DP bucket; 0: 1 MiB on a GPU, bucket_mb on CPU
    first_bucket_mb: float = option(
        0.0,
        "the first gradient bucket, the first to be reduced during backward (default: 1 "
        "on a GPU; on CPU, where the reduction takes the cores backward uses, --bucket-mb, "
        "which makes one bucket of a small model; docs/dp.md)",
    )
    reshard_after_forward: bool = True
    reduce_dtype: str = option(
        "fp32",
        "what gradients cross ranks in: fp32, bf16, or int8/fp8 blocks of 256 values "
        "with a scale each, quantized once per hop and summed in fp32 (dp and ZeRO; "
        "docs/low_precision.md)",
        choices=("fp32", "bf16", *COMPRESSED),
    )
    error_feedback: bool = option(
        True,
        "with --reduce-dtype int8/fp8: do not carry what quantization dropped into the "
        "next step (the ablation; error feedback is on by default)",
        flag="no-error-feedback",
    )
    fp8_all_gather: bool = option(
        False,
        "with --fp8 tensorwise and ZeRO-3: all-gather the FP8 linears' weights in FP8 "
        "(one byte a value; each weight's scale max-reduced over fsdp once a step), "
        "which the linears use as gathered (docs/low_precision.md)",
    )
    # elastic shrink (docs/checkpoint.md): "dp" or "fsdp" (--dp auto / --fsdp auto) takes
    # the world over the other degrees' product at each (re)start; `microbatches` is the
    # count at `elastic_max_world` ranks, whose microbatch size every smaller world keeps
    elastic: str = ""
    elastic_max_world: int = option(
        0,
        "with --dp/--fsdp auto: the world whose microbatch size every smaller world keeps, "
        "accumulating more microbatches (default: the launcher's nnodes MAX x nproc)",
        metavar="N",
    )

    @property
    def degrees(self) -> dict[str, int]:
        """The mesh's axis sizes, outermost first (the order `Mesh` lays ranks out in)."""
        return {"pp": self.pp, "dp": self.dp, "fsdp": self.fsdp, "cp": self.cp, "tp": self.tp}

    @property
    def world(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def data_ranks(self) -> int:
        """Ranks that read different sequences of the batch (cp ranks share theirs)."""
        return self.dp * self.fsdp


@dataclass
class TrainConfig:
    """Optimisation and run control."""

    steps: int = option(200, "optimizer steps")
    global_batch: int = option(16, "sequences per optimizer step, over all data ranks")
    seq_len: int = option(128, "tokens per sequence")
    lr: float = option(3e-3, "peak learning rate (linear warm-up, then cosine decay)")
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = option(0, "the initial weights' and the data's seed")
    dtype: str = option(
        "fp32",
        "compute dtype (default fp32); fp64 verifies: model, optimizer, reductions and"
        " collectives in float64, layouts equal to the single process to 1e-10",
        choices=tuple(DTYPES),
    )
    fp8: str = option(
        "",
        "the blocks' linear layers' matmuls in FP8 with dynamic scales, one per tensor "
        "or one per row, returning --dtype (bf16; fp32 to verify; docs/low_precision.md)",
        choices=("tensorwise", "rowwise"),
    )
    recompute: str = option(
        "none",
        "activation recomputation (default none): selective keeps k/v, attention's output, "
        "wo's and w1's outputs and redoes the rest of each block in backward, full redoes "
        "whole blocks from their inputs",
        choices=RECOMPUTE,
    )
    loss_chunk: int = option(  # tokens per chunk of the fused head + loss (0: full logits)
        1024,
        "apply the head and the loss this many tokens at a time, never holding full logits "
        "(default 1024; 0: full logits)",
        metavar="TOKENS",
    )
    compile: bool = option(
        False,
        "compile each transformer block with torch.compile (inductor), its artifacts "
        "cached under $TORCHINDUCTOR_CACHE_DIR or OUT/compile_cache (docs/compile.md)",
    )
    # steps between counts of the saved activations (0: the first step only): the meter's
    # saved-tensor hooks cost about 3 us per saved tensor, a few % of a small step
    meter_every: int = option(
        0,
        "count the activations autograd saves (metrics' peak_activation_bytes) on the "
        "first step and every N steps after (default 0: the first step only; the shapes "
        "are the same every step, and the count's hooks cost a few percent of a small step)",
        metavar="N",
    )
    out: str = option(
        "runs/default", "the run's directory: metrics, logs, checkpoints (default runs/default)"
    )
    progress: bool = option(True, "no progress display", flag="no-progress")
    device: str = option(
        "auto",
        "auto (default: CUDA if available, else CPU), cpu or cuda",
        choices=("auto", "cpu", "cuda"),
    )
    peak_tflops: float = option(  # 0: look it up from the device (CPU: a nominal figure)
        0.0,
        "declared dense peak of one device in TFLOP/s, for MFU (default: the table in "
        "devices.py; needed for a GPU not in it)",
    )
    timeout: float = option(
        600.0,
        "seconds a collective may block before the job ends naming it, and a signalled "
        "rank may take to save and exit (default 600)",
        metavar="S",
    )
    eval_every: int = option(  # 0: none
        0, "every K steps (and at the end) log eval_loss on a held-out split"
    )
    eval_batches: int = option(4, "global batches in the held-out split (default 4)")
    tensorboard: bool = option(
        False, "also write TensorBoard event files to OUT/tensorboard (needs tetrad[tensorboard])"
    )
    # stragglers (train/straggler.py): every N steps each rank's compute time is compared
    # with the median of its peers'; a rank above `threshold` times it in `windows`
    # windows in a row is named (0: never measured)
    straggler_every: int = option(
        20,
        "every N steps compare each rank's compute time (its own, without collective "
        "waits) with the median of its pipeline stage's ranks (default 20; 0: off; "
        "docs/straggler.md)",
        metavar="N",
    )
    straggler_threshold: float = option(
        1.2,
        "a rank slower than X times that median is slow in that window (default 1.2)",
        metavar="X",
    )
    straggler_windows: int = option(
        3,
        "a rank slow in W windows in a row is named in one warning line and in "
        "metrics.jsonl (straggler_rank, straggler_score) (default 3)",
        metavar="W",
    )


@dataclass
class DataConfig:
    """Where tokens come from: `synthetic`, `stdlib` (the embedded corpus) or a path."""

    source: str = option(
        "stdlib",
        "synthetic, stdlib (default), a text file or folder, or a prepared .u16/.u32 file",
        flag="data",
    )
    max_bytes: int = 16 * 2**20
    tokenizer: str = option(  # a tokenizer.json (Hugging Face tokenizers); "": bytes
        "", "a local tokenizer.json for text data (default: bytes, vocabulary 256)"
    )


@dataclass
class CheckpointConfig:
    """Checkpoint cadence and resume."""

    every: int = option(
        0,
        "save a checkpoint under OUT/checkpoints every N steps (default 0: none but the final one)",
        flag="checkpoint-every",
    )
    resume: bool = option(
        False, "continue from the newest checkpoint under OUT/checkpoints, in any layout"
    )
    keep: int = 2
    async_save: bool = option(  # write in a background thread while training goes on
        False,
        "write checkpoints in a background thread while training continues (the state is "
        "copied first; at most one save in flight; committed once every rank has written)",
        flag="async-checkpoint",
    )
    final: bool = option(  # save the last step's state (a run leaves a model to sample from)
        True,
        "keep no checkpoint of the last step (by default OUT/checkpoints holds it, for "
        "tetrad generate, export and --resume)",
        flag="no-final-checkpoint",
    )
    # in-memory checkpoints with a partner copy (train/local_checkpoint.py): every K steps,
    # 0 = off; in local_dir ("" = /dev/shm/tetrad-<hash of train.out>, one per node)
    local_every: int = option(
        0,
        "every K steps keep each rank's state in node-local memory, with a copy on a "
        "partner rank (the same local rank of the next node; on one node, the next rank); "
        "a restart resumes from it first, losing at most K steps (docs/checkpoint.md; "
        "default 0: off)",
        flag="local-checkpoint-every",
        metavar="K",
    )
    local_dir: str = option(
        "",
        "where in-memory checkpoints live, per node (default /dev/shm/tetrad-<hash of --out>)",
        metavar="DIR",
    )


@dataclass
class Config:
    """The whole job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def from_dict(raw: dict[str, Any]) -> Config:
    """Overlay a nested dict (as read from TOML) on the defaults; unknown keys are errors."""
    cfg = Config()
    sections = sorted(f.name for f in fields(cfg))
    for section, values in raw.items():
        if section not in sections:
            raise ValueError(f"unknown config section [{section}]; known: {sections}")
        if not isinstance(values, dict):
            raise ValueError(f"config section [{section}] must be a table, got {values!r}")
        setattr(cfg, section, _overlay(getattr(cfg, section), values, section))
    return cfg


def _overlay(obj: Any, values: dict[str, Any], section: str) -> Any:
    known = {f.name for f in fields(obj)}
    values = dict(values)
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"unknown key {key!r} in [{section}]; known: {sorted(known)}")
        want = type(getattr(obj, key))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            values[key] = value = float(value)  # TOML's 1 for a float field: 1.0
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ValueError(
                f"[{section}] {key} = {value!r} has type {type(value).__name__}, "
                f"expected {want.__name__}"
            )
    return dataclasses.replace(obj, **values)


def load_raw(path: str | Path) -> dict[str, Any]:
    """A TOML file's tables as written (what it sets, before any default)."""
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def check_sections(cfg: Config) -> None:
    """Raise ValueError naming the offending values of the sections that need no layout
    (the model, training, data and checkpoints), and what this machine cannot run of the
    training settings; `Layout.build` checks the rest."""
    check_model_and_train(cfg.model, cfg.train)
    _check_this_machine(cfg.train)
    _validate_data(cfg.data, cfg.model)
    _validate_checkpoint(cfg.checkpoint)


def _check_this_machine(t: TrainConfig) -> None:
    """What the training settings ask of this machine's torch, GPU and compiler."""
    _require(
        not t.fp8 or _uses_cuda(t.device) or _scaled_mm_on_cpu(),
        f"train.fp8={t.fp8!r} on CPU: torch {torch.__version__} has no CPU kernel for FP8"
        " matmuls (torch._scaled_mm; torch 2.6 has none): a newer torch, or a GPU",
    )
    _require(
        not (t.fp8 == "rowwise" and t.dtype == "fp32" and _uses_cuda(t.device)),
        "train.fp8='rowwise' with train.dtype='fp32' on CUDA: its kernel returns bf16 only",
    )
    _require(
        not t.compile or _uses_cuda(t.device) or _cpp_compiler() is not None,
        "train.compile on CPU: inductor found no C++ compiler (it tries $CXX, else g++): "
        "install one, or set CXX",
    )


def check_model_and_train(model: ModelConfig, train: TrainConfig) -> None:
    """Raise ValueError naming the offending values of a model and its training settings
    (what the planner's layouts are built from, beside the parallel section); not what
    this machine can run (`check_sections`: a plan prices other machines)."""
    check_choices("model", model)
    check_choices("train", train)
    _validate_model(model)
    _validate_train(train, model)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_choices(section: str, values: Any) -> None:
    """Raise ValueError naming the value unless every field of `values` (a section) whose
    option has choices holds its default or one of them."""
    for f in fields(values):
        choices, value = f.metadata.get("cli", {}).get("choices"), getattr(values, f.name)
        if choices and value != f.default:
            _require(value in choices, f"{section}.{f.name}={value!r} is not one of {choices}")


def _validate_model(m: ModelConfig) -> None:
    for name in ("layers", "dim", "heads", "kv_heads", "vocab"):
        _require(getattr(m, name) >= 1, f"model.{name} must be >= 1, got {getattr(m, name)}")
    _require(
        m.head_size or m.dim % m.heads == 0,
        f"model.dim={m.dim} is not divisible by heads={m.heads} (or set head_size)",
    )
    _require(m.head_dim % 2 == 0, f"head_dim={m.head_dim} (dim/heads) must be even for rotary")
    _require(
        m.heads % m.kv_heads == 0,
        f"model.heads={m.heads} is not divisible by kv_heads={m.kv_heads}",
    )
    _require(m.init_std > 0, f"model.init_std must be > 0, got {m.init_std}")
    _require(m.head_size >= 0, f"model.head_size must be >= 0 (0: dim/heads), got {m.head_size}")
    _require(m.sliding_window >= 0, f"model.sliding_window must be >= 0, got {m.sliding_window}")
    _validate_moe(m)


def _validate_moe(m: ModelConfig) -> None:
    _require(
        m.moe == (m.family in ("moe", "deepseek_v3")),
        f"model.experts={m.experts} with family={m.family!r}: experts > 0 is the 'moe' family "
        "(or 'deepseek_v3')",
    )
    if not m.moe:
        return
    _require(
        1 <= m.top_k <= m.experts,
        f"model.top_k={m.top_k} must be in [1, experts={m.experts}]",
    )
    for name in ("moe_ffn_dim", "shared_experts", "dense_layers", "aux_loss_coef", "bias_rate"):
        _require(getattr(m, name) >= 0, f"model.{name} must be >= 0, got {getattr(m, name)}")
    _require(
        m.dense_layers < m.layers,
        f"model.dense_layers={m.dense_layers} leaves no expert layer of layers={m.layers}",
    )
    _require(
        m.capacity_factor >= 0,
        f"model.capacity_factor must be >= 0 (0: dropless), got {m.capacity_factor}",
    )


def _validate_train(t: TrainConfig, model: ModelConfig) -> None:
    for name in ("steps", "global_batch", "eval_batches"):
        _require(getattr(t, name) >= 1, f"train.{name} must be >= 1, got {getattr(t, name)}")
    _require(t.seq_len >= 2, f"train.seq_len must be >= 2, got {t.seq_len}")
    _require(
        t.seq_len <= model.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={model.max_seq_len}",
    )
    _require(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _require(
        0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}"
    )
    _require(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    _require(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 disables), got {t.grad_clip}")
    _require(
        not t.fp8 or t.dtype in ("bf16", "fp32"),
        f"train.fp8={t.fp8!r} needs train.dtype 'bf16' (or 'fp32', to verify), got {t.dtype!r}",
    )
    _require(t.timeout > 0, f"train.timeout must be > 0 seconds, got {t.timeout}")
    _require(t.eval_every >= 0, f"train.eval_every must be >= 0 (0: never), got {t.eval_every}")
    _require(
        not (t.compile and t.recompute == "selective"),
        "train.compile with train.recompute='selective': its tape reads the block's kernels "
        "one by one, which a compiled block does not run; use recompute 'full' or 'none'",
    )
    _require(
        t.meter_every >= 0,
        f"train.meter_every={t.meter_every} must be >= 0 (steps; 0: the first step only)",
    )
    _require(
        t.loss_chunk >= 0,
        f"train.loss_chunk={t.loss_chunk} must be >= 0 (tokens per chunk; 0: full logits)",
    )
    _validate_straggler(t)


def _validate_data(d: DataConfig, model: ModelConfig) -> None:
    if d.source == "stdlib":
        _require(
            model.vocab >= 256 or bool(d.tokenizer),
            f"data.source='stdlib' is byte-level: model.vocab={model.vocab} must be >= 256",
        )
    elif d.source != "synthetic":
        _require(Path(d.source).exists(), f"data.source={d.source!r}: no such file or directory")
    if d.tokenizer:
        _require(Path(d.tokenizer).exists(), f"data.tokenizer={d.tokenizer!r}: no such file")


def _cpp_compiler() -> str | None:
    """The C++ compiler inductor would use on CPU (torch's own search), or None."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        return get_cpp_compiler()
    except InvalidCxxCompiler:
        return None


def _validate_straggler(t: TrainConfig) -> None:
    _require(
        t.straggler_every >= 0,
        f"train.straggler_every={t.straggler_every} must be >= 0 (steps per window; 0: off)",
    )
    _require(
        t.straggler_threshold > 1,
        f"train.straggler_threshold={t.straggler_threshold} must be > 1 (a multiple of the "
        "median compute time; at 1 or below half the ranks would be named)",
    )
    _require(
        t.straggler_windows >= 1,
        f"train.straggler_windows={t.straggler_windows} must be >= 1",
    )


@functools.cache
def _scaled_mm_on_cpu() -> bool:
    """Whether this torch runs `torch._scaled_mm` (FP8 matmuls) on CPU."""
    one, a = torch.tensor(1.0), torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _uses_cuda(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _require(c.every >= 0, f"checkpoint.every must be >= 0 (0: never), got {c.every}")
    _require(c.keep >= 1, f"checkpoint.keep must be >= 1, got {c.keep}")
    _require(
        c.local_every >= 0,
        f"checkpoint.local_every (--local-checkpoint-every) must be >= 0 (0: off), "
        f"got {c.local_every}",
    )
