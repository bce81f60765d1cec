"""Typed configuration: dataclasses per component, TOML loading, CLI overrides, validation.

Every rank checks the whole configuration before the first collective (`Layout.build`
runs these section checks and the layout's own), so a bad value fails the same way
everywhere with a `ValueError` that names it.
"""

from __future__ import annotations

import dataclasses
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
# activation recomputation: nothing, the cheap and large parts, or whole blocks
RECOMPUTE = ("none", "selective", "full")
# context parallelism's attention: keys and values all-gathered, or passed around a ring
CP_ATTENTION = ("allgather", "ring")
# how a cp core attends one block: torch's fused kernel where it has one, or plain matmuls
CP_KERNELS = ("fused", "unfused")
# mixture of experts: how router scores become weights, and how experts' load is balanced
ROUTERS = ("softmax", "sigmoid")
BALANCE = ("aux", "bias", "none")


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder. `ffn_dim=0` derives it Llama-style from `dim`.
    `family` names the model family (models/families.py) whose ModelSpec parallel code reads."""

    name: str = "small"
    family: str = "llama"
    layers: int = 4
    dim: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    ffn_dim: int = 0
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    init_from_hf: str = ""  # a Hugging Face Llama directory: its shape and its weights
    head_size: int = 0  # channels per attention head; 0: dim // heads (Qwen3 sets its own)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys before rotary (Qwen3)
    # mixture of experts (family "moe"; docs/moe.md): from layer `dense_layers` on, the
    # feed-forward is a router over `experts` SwiGLU experts of `moe_ffn_dim`, each token
    # sent to `top_k` of them, plus `shared_experts` every token uses
    experts: int = 0  # 0: dense
    top_k: int = 2
    moe_ffn_dim: int = 0  # 0: hidden_dim
    shared_experts: int = 0
    dense_layers: int = 0
    router: str = "softmax"  # softmax then top-k, renormalised; or sigmoid (DeepSeek-V3)
    balance: str = "aux"  # auxiliary loss, loss-free per-expert bias, or none
    aux_loss_coef: float = 0.01
    bias_rate: float = 0.001  # the loss-free bias's step per training step
    capacity_factor: float = 0.0  # 0: dropless (every token reaches its top_k experts)

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
        if self.ffn_dim:
            return self.ffn_dim
        return 32 * -(-(8 * self.dim // 3) // 32)


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(layers=2, dim=32, heads=4, kv_heads=2, vocab=256),
    "small": dict(layers=4, dim=128, heads=4, kv_heads=2, vocab=256),
    "base": dict(layers=8, dim=256, heads=8, kv_heads=4, vocab=256),
    "llama3-8b": dict(
        layers=32,
        dim=4096,
        heads=32,
        kv_heads=8,
        vocab=128256,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": dict(
        layers=80,
        dim=8192,
        heads=64,
        kv_heads=8,
        vocab=128256,
        ffn_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # mixtures of experts: the first two train here, the rest are for the planner
    "moe-tiny": dict(
        family="moe", layers=2, dim=32, heads=4, kv_heads=2, vocab=256,
        experts=4, top_k=2, moe_ffn_dim=32, shared_experts=1,
    ),
    "moe-small": dict(
        family="moe", layers=4, dim=128, heads=4, kv_heads=2, vocab=256,
        experts=8, top_k=2, moe_ffn_dim=128, shared_experts=1, dense_layers=1,
    ),
    "mixtral-8x7b": dict(
        family="moe", layers=32, dim=4096, heads=32, kv_heads=8, vocab=32000,
        experts=8, top_k=2, moe_ffn_dim=14336, max_seq_len=32768, rope_theta=1e6,
    ),
    "qwen3-30b-a3b": dict(
        family="moe", layers=48, dim=2048, heads=32, kv_heads=4, head_size=128,
        vocab=151936, experts=128, top_k=8, moe_ffn_dim=768, max_seq_len=40960,
        rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
    ),
    "qwen3-235b-a22b": dict(
        family="moe", layers=94, dim=4096, heads=64, kv_heads=4, head_size=128,
        vocab=151936, experts=128, top_k=8, moe_ffn_dim=1536, max_seq_len=40960,
        rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
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

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks (docs/cp.md)
    cp_attention: str = "allgather"  # how attention crosses the cp ranks: allgather or ring
    cp_kernel: str = "fused"  # a cp core's block attention: fused kernel or unfused matmuls
    ep: int = 1  # expert parallelism: experts sharded over ep ranks borrowed from the data
    # (and tensor) ranks; not a mesh axis of its own, so it does not enlarge the world
    zero_stage: int = 3
    sp: bool = False
    pp_schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    pp_split: str = ""
    bucket_mb: float = 25.0
    # the first (earliest-ready) DP bucket; 0: 1 MiB on a GPU, bucket_mb on CPU (docs/dp.md)
    first_bucket_mb: float = 0.0
    reshard_after_forward: bool = True
    reduce_dtype: str = "fp32"
    # elastic shrink (docs/checkpoint.md): "dp" or "fsdp" (--dp auto / --fsdp auto) takes
    # the world over the other degrees' product at each (re)start; `microbatches` is the
    # count at `elastic_max_world` ranks, whose microbatch size every smaller world keeps
    elastic: str = ""
    elastic_max_world: int = 0

    @property
    def degrees(self) -> dict[str, int]:
        """The mesh's axis sizes, outermost first (the order `Mesh` lays ranks out in)."""
        return {"pp": self.pp, "dp": self.dp, "fsdp": self.fsdp, "cp": self.cp, "tp": self.tp}

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def data_ranks(self) -> int:
        """Ranks that read different sequences of the batch (cp ranks share theirs)."""
        return self.dp * self.fsdp


@dataclass
class TrainConfig:
    """Optimisation and run control."""

    steps: int = 200
    global_batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "fp32"
    recompute: str = "none"  # activation recomputation: none, selective or full
    loss_chunk: int = 1024  # tokens per chunk of the fused head + loss (0: full logits)
    # steps between counts of the saved activations (0: the first step only): the meter's
    # saved-tensor hooks cost about 3 us per saved tensor, a few % of a small step
    meter_every: int = 0
    out: str = "runs/default"
    progress: bool = True
    device: str = "auto"
    peak_tflops: float = 0.0  # 0: look it up from the device (CPU: a nominal figure)
    timeout: float = 600.0  # seconds a collective may block (and a stop may take) before exit
    eval_every: int = 0  # steps between held-out evaluations (0: none)
    eval_batches: int = 4  # global batches of the held-out split per evaluation
    tensorboard: bool = False  # also write TensorBoard event files beside metrics.jsonl
    # stragglers (train/straggler.py): every N steps each rank's compute time is compared
    # with the median of its peers'; a rank above `threshold` times it in `windows`
    # windows in a row is named (0: never measured)
    straggler_every: int = 20
    straggler_threshold: float = 1.2
    straggler_windows: int = 3


@dataclass
class DataConfig:
    """Where tokens come from: `synthetic`, `stdlib` (the embedded corpus) or a path."""

    source: str = "stdlib"
    max_bytes: int = 16 * 2**20
    tokenizer: str = ""  # a tokenizer.json (Hugging Face tokenizers); "": bytes


@dataclass
class CheckpointConfig:
    """Checkpoint cadence and resume."""

    every: int = 0
    resume: bool = False
    keep: int = 2
    async_save: bool = False  # write in a background thread while training goes on
    final: bool = True  # save the last step's state (a run leaves a model to sample from)
    # in-memory checkpoints with a partner copy (train/local_checkpoint.py): every K steps,
    # 0 = off; in local_dir ("" = /dev/shm/tetrad-<hash of train.out>, one per node)
    local_every: int = 0
    local_dir: str = ""


@dataclass
class Config:
    """The whole job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def microbatch_size(self) -> int:
        return self.train.global_batch // (self.parallel.data_ranks * self.parallel.microbatches)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
}


def from_dict(raw: dict[str, Any], base: Config | None = None) -> Config:
    """Overlay a nested dict (as read from TOML) on `base`; unknown keys are errors."""
    cfg = dataclasses.replace(base) if base else Config()
    for section, values in raw.items():
        if section not in _SECTION_TYPES:
            raise ValueError(f"unknown config section [{section}]; known: {sorted(_SECTION_TYPES)}")
        if not isinstance(values, dict):
            raise ValueError(f"config section [{section}] must be a table, got {values!r}")
        setattr(cfg, section, _overlay(getattr(cfg, section), values, section))
    return cfg


def _overlay(obj: Any, values: dict[str, Any], section: str) -> Any:
    known = {f.name: f for f in fields(obj)}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"unknown key {key!r} in [{section}]; known: {sorted(known)}")
        want = type(getattr(obj, key))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
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


def load_toml(path: str | Path, base: Config | None = None) -> Config:
    """Read a TOML file into a Config (on top of `base`)."""
    return from_dict(load_raw(path), base)


def check_sections(cfg: Config) -> None:
    """Raise ValueError naming the offending values of the sections that need no layout
    (the model, training, data and checkpoints); `Layout.build` checks the rest."""
    _validate_model(cfg.model)
    _validate_train(cfg)
    _validate_checkpoint(cfg.checkpoint)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _validate_model(m: ModelConfig) -> None:
    for name in ("layers", "dim", "heads", "kv_heads", "vocab"):
        _require(getattr(m, name) >= 1, f"model.{name} must be >= 1, got {getattr(m, name)}")
    _require(m.dim % m.heads == 0, f"model.dim={m.dim} is not divisible by heads={m.heads}")
    _require(m.head_dim % 2 == 0, f"head_dim={m.head_dim} (dim/heads) must be even for rotary")
    _require(
        m.heads % m.kv_heads == 0,
        f"model.heads={m.heads} is not divisible by kv_heads={m.kv_heads}",
    )
    _require(m.init_std > 0, f"model.init_std must be > 0, got {m.init_std}")
    _require(m.head_size >= 0, f"model.head_size must be >= 0 (0: dim/heads), got {m.head_size}")
    _validate_moe(m)


def _validate_moe(m: ModelConfig) -> None:
    _require(
        m.moe == (m.family == "moe"),
        f"model.experts={m.experts} with family={m.family!r}: experts > 0 is the 'moe' family",
    )
    if not m.moe:
        return
    _require(
        1 <= m.top_k <= m.experts,
        f"model.top_k={m.top_k} must be in [1, experts={m.experts}]",
    )
    for name in ("moe_ffn_dim", "shared_experts", "dense_layers"):
        _require(getattr(m, name) >= 0, f"model.{name} must be >= 0, got {getattr(m, name)}")
    _require(
        m.dense_layers < m.layers,
        f"model.dense_layers={m.dense_layers} leaves no expert layer of layers={m.layers}",
    )
    _require(m.router in ROUTERS, f"model.router={m.router!r} is not one of {ROUTERS}")
    _require(m.balance in BALANCE, f"model.balance={m.balance!r} is not one of {BALANCE}")
    _require(m.aux_loss_coef >= 0, f"model.aux_loss_coef must be >= 0, got {m.aux_loss_coef}")
    _require(m.bias_rate >= 0, f"model.bias_rate must be >= 0, got {m.bias_rate}")
    _require(
        m.capacity_factor >= 0,
        f"model.capacity_factor must be >= 0 (0: dropless), got {m.capacity_factor}",
    )


def _validate_train(cfg: Config) -> None:
    t = cfg.train
    _require(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    _require(t.global_batch >= 1, f"train.global_batch must be >= 1, got {t.global_batch}")
    _require(t.seq_len >= 2, f"train.seq_len must be >= 2, got {t.seq_len}")
    _require(
        t.seq_len <= cfg.model.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}",
    )
    _require(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _require(
        0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}"
    )
    _require(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    _require(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 disables), got {t.grad_clip}")
    _require(t.dtype in DTYPES, f"train.dtype={t.dtype!r} not in {tuple(DTYPES)}")
    _require(t.device in ("auto", "cpu", "cuda"), f"train.device={t.device!r} not auto/cpu/cuda")
    _require(t.timeout > 0, f"train.timeout must be > 0 seconds, got {t.timeout}")
    _require(t.eval_every >= 0, f"train.eval_every must be >= 0 (0: never), got {t.eval_every}")
    _require(t.eval_batches >= 1, f"train.eval_batches must be >= 1, got {t.eval_batches}")
    _require(
        t.dtype != "bf16" or _bf16_supported(t.device),
        f"train.dtype='bf16' but this CUDA device ({_cuda_name()}) has no bf16 support;"
        " use dtype='fp32'",
    )
    _require(t.recompute in RECOMPUTE, f"train.recompute={t.recompute!r} is not one of {RECOMPUTE}")
    _require(
        t.meter_every >= 0,
        f"train.meter_every={t.meter_every} must be >= 0 (steps; 0: the first step only)",
    )
    _require(
        t.loss_chunk >= 0,
        f"train.loss_chunk={t.loss_chunk} must be >= 0 (tokens per chunk; 0: full logits)",
    )
    _validate_straggler(t)
    d = cfg.data
    if d.source == "stdlib":
        _require(
            cfg.model.vocab >= 256 or bool(d.tokenizer),
            f"data.source='stdlib' is byte-level: model.vocab={cfg.model.vocab} must be >= 256",
        )
    elif d.source != "synthetic":
        _require(Path(d.source).exists(), f"data.source={d.source!r}: no such file or directory")
    if d.tokenizer:
        _require(Path(d.tokenizer).exists(), f"data.tokenizer={d.tokenizer!r}: no such file")


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


def _uses_cuda(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _bf16_supported(device: str) -> bool:
    """CPUs compute bf16 (natively or emulated); a CUDA device only from Ampere on."""
    if not _uses_cuda(device) or not torch.cuda.is_available():
        return True  # no CUDA device to ask: the trainer's own device check speaks then
    return torch.cuda.is_bf16_supported(including_emulation=False)


def _cuda_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _require(c.every >= 0, f"checkpoint.every must be >= 0 (0: never), got {c.every}")
    _require(c.keep >= 1, f"checkpoint.keep must be >= 1, got {c.keep}")
    _require(
        c.local_every >= 0,
        f"checkpoint.local_every (--local-checkpoint-every) must be >= 0 (0: off), "
        f"got {c.local_every}",
    )
