"""Hugging Face checkpoints in and out (Llama, Mistral, Qwen2/2.5, Qwen3, Mixtral,
Qwen3-MoE, DeepSeek-V3): config.json <-> ModelConfig, weights by name (docs/models.md).

A Hugging Face Llama directory holds `config.json` and either one `model.safetensors` or
shards listed in `model.safetensors.index.json`. Import reads headers first (every name,
shape and dtype checked before a byte of weights is read), then each rank reads only the
slices its layout holds, through safetensors' lazy slicing. Export writes the same layout
back, sharded with an index when large. Pickled `.bin` checkpoints are refused: loading
them would run code from the file.

Rotary layout: tetrad rotates interleaved channel pairs (2i, 2i+1) of each head; Hugging
Face's `rotate_half` pairs channel i with i + head_dim/2. So the rows of q and k are
permuted within each head on the way in and back on the way out:
tetrad row 2i = HF row i, tetrad row 2i+1 = HF row i + head_dim/2. Qwen3's per-head
QK-norm gains and Qwen2's q and k biases are permuted alike (their channels are q's and k's).
DeepSeek-V3 stores its rotated channels interleaved already (`rope_interleave`): no permutation.

Mixture of experts: a checkpoint stores one tensor per expert
(`...experts.{j}.w1.weight`); tetrad stacks them along a first dimension of experts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tetrad.config import ModelConfig
from tetrad.models import deepseek_spec
from tetrad.models.families import spec_for
from tetrad.models.init import full_shape
from tetrad.models.moe_spec import QWEN3_MOE_NAMES

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# model_type -> its transformers class; a dense type is also the name of its tetrad family
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
MODEL_TYPES = tuple(ARCHITECTURES)
# what a type's attention has beyond Llama's: (QK-norm, q/k/v biases), and which types
# have a sliding window (a window shorter than the sequence is refused: layout.py)
SWITCHES = {"qwen2": (False, True), "qwen3": (True, False), "qwen3_moe": (True, False)}
WINDOWED = ("mistral", "mixtral")


def model_type(model: ModelConfig) -> str:
    """The Hugging Face model_type `model` is written as (the MoE family's: Qwen3-MoE with
    QK-norm, else Mixtral)."""
    if model.family == "moe":
        return "qwen3_moe" if model.qk_norm else "mixtral"
    return model.family


def hf_name(name: str, model: ModelConfig) -> str:
    """The Hugging Face name of tetrad parameter `name` (its family's `ModelSpec.hf_names`,
    or those of the Hugging Face model it is written as where they differ); "{j}" in it: a
    stack of per-expert tensors (`hf_keys`)."""
    spec = spec_for(model)
    if model_type(model) == "qwen3_moe":
        spec = dataclasses.replace(spec, hf_names=QWEN3_MOE_NAMES)
    elif model.family == "deepseek_v3" and not model.q_lora_rank:
        spec = dataclasses.replace(spec, hf_names=deepseek_spec.PLAIN_Q_NAMES)
    return spec.hf_name(name)


def stacked(name: str, model: ModelConfig) -> bool:
    """Whether tetrad tensor `name` stacks one Hugging Face tensor per expert."""
    return "{j}" in hf_name(name, model)


def hf_keys(name: str, model: ModelConfig) -> list[str]:
    """The Hugging Face tensors holding tetrad tensor `name`: one, or one per expert."""
    key = hf_name(name, model)
    if "{j}" not in key:
        return [key]
    return [key.replace("{j}", str(j)) for j in range(full_shape(name, model)[0])]


# --- config.json --------------------------------------------------------------------------


def read_config(directory: str | Path) -> tuple[dict[str, Any], Path]:
    """A Hugging Face Llama `config.json` and its path (which errors name), or a ValueError
    saying why this is not one."""
    d = Path(directory)
    file = d / CONFIG
    if not d.is_dir():
        raise ValueError(f"--init-from-hf {d}: no such directory")
    if not file.is_file():
        raise ValueError(f"{d} is not a Hugging Face checkpoint: {CONFIG} is missing")
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is unreadable: {e}") from e
    if raw.get("model_type") not in MODEL_TYPES:
        raise ValueError(
            f"{file}: model_type={raw.get('model_type')!r}, expected one of {MODEL_TYPES}"
        )
    return raw, file


def _rope_theta(raw: dict[str, Any], file: Path) -> float:
    """rope_theta, from the top level (transformers 4) or rope_parameters (transformers 5);
    scaled rotary variants (llama3, yarn, ...) are refused: tetrad computes plain rotary."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ValueError(f"{file}: rope_type={kind!r} is not supported (only 'default')")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    return float(theta)


# ModelConfig field -> its key in config.json: how the dense fields are read and written,
# and how errors name a field (the MoE ones, which differ by type: MOE_INTS)
HF_KEYS = {
    "layers": "num_hidden_layers",
    "dim": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
    "ffn_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "head_size": "head_dim",
    "experts": "num_local_experts (Mixtral) / num_experts (Qwen3-MoE) / n_routed_experts",
    "top_k": "num_experts_per_tok",
    "moe_ffn_dim": "intermediate_size (Mixtral) / moe_intermediate_size",
    "dense_layers": "mlp_only_layers (Qwen3-MoE) / first_k_dense_replace (DeepSeek-V3)",
    "routed_scaling": "routed_scaling_factor",
    # named alike, and what the type decides
    **{f: f for f in ("rope_theta", "sliding_window", "norm_topk_prob", "q_lora_rank")},
    **dict.fromkeys(("family", "qk_norm", "qkv_bias", "router", "balance"), "model_type"),
}
# the fields every config.json gives (in the order a missing one is named)
REQUIRED = ("dim", "ffn_dim", "layers", "heads", "vocab")
# ModelConfig field -> its integer in config.json, by MoE model_type, both ways (Qwen3-MoE's
# experts: `_qwen3_moe_fields`, under either of two keys)
MOE_INTS = {
    "mixtral": {
        "experts": "num_local_experts", "top_k": "num_experts_per_tok",
        "moe_ffn_dim": "intermediate_size",
    },
    "qwen3_moe": {"top_k": "num_experts_per_tok", "moe_ffn_dim": "moe_intermediate_size"},
    "deepseek_v3": {
        "experts": "n_routed_experts", "top_k": "num_experts_per_tok",
        "moe_ffn_dim": "moe_intermediate_size", "shared_experts": "n_shared_experts",
        "dense_layers": "first_k_dense_replace", "n_group": "n_group",
        "topk_group": "topk_group", "kv_lora_rank": "kv_lora_rank",
        "qk_nope_dim": "qk_nope_head_dim", "qk_rope_dim": "qk_rope_head_dim",
        "v_head_dim": "v_head_dim",
    },
}  # fmt: skip
HF_KEYS |= {f: k for f, k in MOE_INTS["deepseek_v3"].items() if f not in HF_KEYS}  # its own


def model_fields(directory: str | Path) -> dict[str, Any]:
    """ModelConfig fields from a Hugging Face Llama `config.json`."""
    raw, file = read_config(directory)
    missing = [HF_KEYS[f] for f in REQUIRED if HF_KEYS[f] not in raw]
    if missing:
        raise ValueError(f"{file}: missing {missing}")
    kind = raw["model_type"]
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if raw.get(flag):
            raise ValueError(f"{file}: {flag}=true is not supported (tetrad's Llama has none)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{file}: hidden_act={raw['hidden_act']!r}, expected 'silu'")
    fields = {"name": "hf"} | {f: int(raw[HF_KEYS[f]]) for f in REQUIRED}
    heads, dim = fields["heads"], fields["dim"]
    head_dim = raw.get("head_dim") or dim // heads
    fields |= {
        "kv_heads": int(raw.get("num_key_value_heads") or heads),
        "max_seq_len": int(raw.get("max_position_embeddings", 4096)),
        "rope_theta": _rope_theta(raw, file),
        "norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "head_size": head_dim if head_dim * heads != dim else 0,
        "qk_norm": SWITCHES.get(kind, (False, False))[0],
        "qkv_bias": SWITCHES.get(kind, (False, False))[1],
        "sliding_window": int(raw.get("sliding_window") or 0) if kind in WINDOWED else 0,
        "family": "moe" if kind in ("mixtral", "qwen3_moe") else kind,
    }
    fields |= {f: _int(raw, key, file) for f, key in MOE_INTS.get(kind, {}).items()}
    if kind == "qwen3_moe":
        fields |= _qwen3_moe_fields(raw, file)
    if kind == "deepseek_v3":
        fields |= _deepseek_fields(raw, file)
    return fields


def _qwen3_moe_fields(raw: dict[str, Any], file: Path) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE config.json beyond `MOE_INTS`': the dense layers
    first, the top-k weights renormalised (what tetrad computes; other settings are
    refused)."""
    if not raw.get("norm_topk_prob", False):
        raise ValueError(f"{file}: norm_topk_prob=false is not supported (tetrad renormalises)")
    if int(raw.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"{file}: decoder_sparse_step={raw['decoder_sparse_step']} (only 1)")
    dense = sorted(raw.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ValueError(f"{file}: mlp_only_layers={dense}: tetrad's dense layers come first")
    return {
        # "num_experts" in the published checkpoints; transformers 5 writes its alias
        "experts": _int(raw, "num_experts" if "num_experts" in raw else "num_local_experts", file),
        "dense_layers": len(dense),
    }


def _deepseek_fields(raw: dict[str, Any], file: Path) -> dict[str, Any]:
    """The fields of a DeepSeek-V3 config.json beyond `MOE_INTS`': latent attention (no
    grouped-query heads, no head size of its own) and its MoE (sigmoid router, loss-free
    bias, expert groups). Weights stored in rotate_half order (rope_interleave false) are
    refused."""
    if not raw.get("rope_interleave", True):
        raise ValueError(f"{file}: rope_interleave=false is not supported (tetrad's rotary "
                         "pairs are interleaved)")  # fmt: skip
    if raw.get("quantization_config"):  # the published checkpoint: FP8 blocks with scales
        raise ValueError(f"{file}: quantization_config is set; tetrad reads unquantised "
                         "weights (convert the checkpoint to bf16 first)")  # fmt: skip
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(key, want) != want:
            raise ValueError(f"{file}: {key}={raw[key]!r} is not supported (only {want!r})")
    return {
        "kv_heads": int(raw["num_attention_heads"]), "head_size": 0,
        "q_lora_rank": int(raw.get("q_lora_rank") or 0),
        "routed_scaling": float(raw.get("routed_scaling_factor", 1.0)),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
        "router": "sigmoid", "balance": "bias",
    }  # fmt: skip


def _int(raw: dict[str, Any], key: str, file: Path) -> int:
    if key not in raw:
        raise ValueError(f"{file}: missing {key!r}")
    return int(raw[key])


def model_config(directory: str | Path, given: dict[str, Any] | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory. `given`: values the user set (flag name ->
    (field, value)); one that contradicts config.json is an error naming both."""
    model = ModelConfig(**model_fields(directory), init_from_hf=str(directory))
    for flag, (field, value) in (given or {}).items():
        if getattr(model, field) != value:
            raise ValueError(
                f"{flag}={value} contradicts {HF_KEYS[field]}={getattr(model, field)} in "
                f"{Path(directory) / CONFIG}"
            )
    return model


def check_model(directory: str | Path, model: ModelConfig) -> None:
    """The configured model is the one in `directory` (every rank, before training)."""
    fields = model_fields(directory)
    mine = {k: getattr(model, k) for k in HF_KEYS if k in fields} | {"ffn_dim": model.hidden_dim}
    bad = [k for k, v in mine.items() if v != fields[k]]
    if bad:
        detail = ", ".join(f"model.{k}={mine[k]} vs {HF_KEYS[k]}={fields[k]}" for k in bad)
        raise ValueError(f"the model does not match {Path(directory) / CONFIG}: {detail}")


# --- weights in ---------------------------------------------------------------------------


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    d = Path(directory)
    if (d / INDEX).is_file():
        try:
            weight_map = json.loads((d / INDEX).read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{d / INDEX} is unreadable: {e!r}") from e
        files = {name: d / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ValueError(f"{d / INDEX} lists shard {f.name}, which is missing from {d}")
        return files
    if (d / SINGLE).is_file():
        with safe_open(d / SINGLE, framework="pt") as fh:
            return {name: d / SINGLE for name in fh.keys()}  # noqa: SIM118
    if any(d.glob("*.bin")):
        raise ValueError(
            f"{d} holds only pickled .bin weights, which tetrad does not load (unpickling runs "
            "code); convert them to safetensors first"
        )
    raise ValueError(f"{d} has neither {SINGLE} nor {INDEX}")


# the MoE router's loss-free bias (a buffer): DeepSeek-V3's e_score_correction_bias
ROUTING_BIAS = "expert_bias"


class HFWeights(dict):
    """tetrad name -> a lazy tensor (`LazyParam`) in a Hugging Face directory, indexable by
    this rank's slice (`weights[name][rows, cols]` reads those elements only), as float32.
    The model's buffers a checkpoint holds (DeepSeek-V3's trained routing bias) are read
    apart, by `read_buffer`: the engine loads parameters from the mapping, buffers from a
    reader.

    Constructing it checks every tensor the model needs: present, float, the right shape.
    """

    def __init__(self, directory: str | Path, model: ModelConfig):
        self.directory, self.model = Path(directory), model
        self.files = weight_files(directory)
        meta = spec_for(model).build(model)
        headers = self._headers()
        self.buffers = self._check_buffers(meta, headers)
        for name, _ in meta.named_parameters():
            want = tuple(full_shape(name, model))
            if stacked(name, model):
                want = want[1:]  # each expert's
            for key in hf_keys(name, model):
                self._check(key, want, headers)
            self[name] = LazyParam(self, name)

    def _check(self, key: str, want: tuple[int, ...], headers: dict) -> None:
        """Refuse Hugging Face tensor `key` missing, not a float, or not of shape `want`."""
        if key not in self.files:
            raise ValueError(f"{self.directory}: tensor {key} is missing")
        dtype, shape = headers[key]
        if dtype not in FLOATS:
            raise ValueError(f"{self.files[key]}: {key} has dtype {dtype}; expected a float")
        if shape != want:
            raise ValueError(f"{self.files[key]}: {key} has shape {shape}, expected {want}")

    def _check_buffers(self, meta: torch.nn.Module, headers: dict) -> dict[str, str]:
        """tetrad buffer -> the Hugging Face tensor holding it: DeepSeek-V3's routers'
        loss-free bias (e_score_correction_bias), which changes which experts a token
        gets, checked like a parameter; the other families' routers hold none (theirs
        start at zero, as tetrad's)."""
        if model_type(self.model) != "deepseek_v3":
            return {}
        out = {}
        for name, b in meta.named_buffers():
            key = hf_name(name, self.model)
            if name.endswith(ROUTING_BIAS) and key in self.files:
                self._check(key, tuple(b.shape), headers)
                out[name] = key
        return out

    def read_buffer(self, key: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """Elements `box` ((start, stop) per dim) of model buffer `key` ("buffer/<name>",
        as the state adapter's `load_buffers` asks), float32: the checkpoint's value, or
        zeros (tetrad's start) where it holds none."""
        name = key.rpartition("/")[2]
        if name not in self.buffers:
            return torch.zeros([hi - lo for lo, hi in box])
        return self._slice(self.buffers[name], tuple(slice(lo, hi) for lo, hi in box))

    def _slice(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Elements `index` of Hugging Face tensor `key` (only those are read), float32."""
        with safe_open(self.files[key], framework="pt") as fh:
            return fh.get_slice(key)[index].float()

    def _headers(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        out = {}
        for file in sorted(set(self.files.values())):
            with safe_open(file, framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118
                    s = fh.get_slice(key)
                    out[key] = (s.get_dtype(), tuple(s.get_shape()))
        return out

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Elements `index` of tetrad tensor `name` (rows in tetrad's order), float32."""
        if stacked(name, self.model):
            return self._read_experts(name, index)
        rotary = name.endswith(ROTARY)
        rows, rest = index[0], index[1:]
        hd = self.model.head_dim
        lo, hi, step = rows.indices(full_shape(name, self.model)[0])
        # q/k rows permute within a head: read whole heads, permute, then keep the rows
        # (and every row where only some are asked for)
        whole = step != 1 or (rotary and (lo % hd or hi % hd))
        t = self._slice(hf_name(name, self.model), (slice(None) if whole else slice(lo, hi), *rest))
        if rotary:
            t = permute(t, hd)
        return t[rows] if whole else t

    def _read_experts(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Elements `index` of a stack of per-expert tensors: the experts index[0] selects."""
        keys = hf_keys(name, self.model)
        shape = full_shape(name, self.model)
        experts = range(*index[0].indices(len(keys)))
        parts = [self._slice(keys[j], index[1:]) for j in experts]
        if parts:
            return torch.stack(parts)
        rest = [len(range(*s.indices(n))) for s, n in zip(index[1:], shape[1:])]
        return torch.zeros(0, *rest)


class LazyParam:
    """One tensor of an `HFWeights`, read when indexed (`[...]`: all of it)."""

    def __init__(self, weights: HFWeights, name: str):
        self.weights, self.name = weights, name
        self.shape = torch.Size(full_shape(name, weights.model))

    def __getitem__(self, index) -> torch.Tensor:
        if index is Ellipsis:
            index = ()
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        return self.weights.read(self.name, index)


# tetrad tensors whose rows a rotary permutation reorders: q's and k's (each head's rows),
# their biases, and QK-norm's gains (one head's channels)
ROTARY = tuple(f"attention.{p}" for p in ("wq.weight", "wq.bias", "wk.weight", "wk.bias",
                                          "q_norm.weight", "k_norm.weight"))  # fmt: skip


def permute(w: torch.Tensor, head_dim: int, to_hf: bool = False) -> torch.Tensor:
    """Rows of whole heads from rotate_half order (i, i + d/2) to interleaved pairs, or
    (`to_hf`) back."""
    pairs = (head_dim // 2, 2) if to_hf else (2, head_dim // 2)
    return w.reshape(-1, *pairs, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# --- weights out --------------------------------------------------------------------------


def to_hf_state(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """tetrad's full logical tensors -> Hugging Face names and rotary order. The routers'
    loss-free bias (a buffer, given with the parameters) is kept by DeepSeek-V3 alone."""
    out = {}
    for name, t in state.items():
        if name.endswith(ROUTING_BIAS) and model_type(model) != "deepseek_v3":
            continue
        if name.endswith(ROTARY):
            t = permute(t, model.head_dim, to_hf=True)
        parts = t.unbind() if stacked(name, model) else [t]  # one per expert, or itself
        out |= {key: p.contiguous() for key, p in zip(hf_keys(name, model), parts, strict=True)}
    return out


def check_routing_bias(state: dict[str, torch.Tensor], model: ModelConfig) -> None:
    """A DeepSeek-V3 model trained with the loss-free balance routes by its bias: exported
    without it, transformers would choose other experts. Refuse a state that lacks it."""
    layers = range(model.dense_layers, model.layers)
    missing = [i for i in layers if f"layers.{i}.feed_forward.router.{ROUTING_BIAS}" not in state]
    if model_type(model) == "deepseek_v3" and model.balance == "bias" and missing:
        raise ValueError(
            f"model.balance='bias': the routers' {ROUTING_BIAS} of layers {missing} is not in "
            "the state to export, and without it transformers would route to other experts "
            "(the checkpoint's buffers hold it: load_model(run, buffers=True))"
        )


def hf_config(model: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A `config.json` that transformers' class of this model's type (`ARCHITECTURES`)
    reads as this model (one `check_exportable` accepts: `save` checks first)."""
    kind = model_type(model)
    same = ("layers", "dim", "heads", "kv_heads", "vocab", "max_seq_len", "norm_eps",
            "rope_theta", "tie_embeddings")  # fmt: skip
    out = {"architectures": [ARCHITECTURES[kind]], "model_type": kind}
    out |= {HF_KEYS[f]: getattr(model, f) for f in same}
    out |= {
        "intermediate_size": model.hidden_dim,
        "head_dim": model.head_dim,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": model.init_std,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if kind in WINDOWED:
        out["sliding_window"] = model.sliding_window or None
    elif kind in SWITCHES:
        out["use_sliding_window"] = False
    # the MoE integers; one expert's width is the dense one unless set (`expert_dim`)
    ints = MOE_INTS.get(kind, {}).items()
    out |= {key: getattr(model, "expert_dim" if f == "moe_ffn_dim" else f) for f, key in ints}
    if kind == "deepseek_v3":
        return out | _deepseek_config(model)
    if model.family == "moe":
        out |= {"output_router_logits": False, "router_aux_loss_coef": model.aux_loss_coef}
    if kind == "qwen3_moe":
        out |= {"num_experts": model.experts, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": list(range(model.dense_layers))}  # fmt: skip
    return out


def _deepseek_config(m: ModelConfig) -> dict[str, Any]:
    """What a DeepSeek-V3 config.json has beyond `MOE_INTS`' (rotary over the rope
    channels, interleaved; no multi-token prediction layer)."""
    return {
        "num_key_value_heads": m.heads, "head_dim": m.qk_rope_dim,
        "q_lora_rank": m.q_lora_rank or None, "qk_head_dim": m.qk_nope_dim + m.qk_rope_dim,
        "rope_interleave": True, "routed_scaling_factor": m.routed_scaling,
        "norm_topk_prob": m.norm_topk_prob, "num_nextn_predict_layers": 0,
    }  # fmt: skip


def check_exportable(model: ModelConfig) -> None:
    """Refuse a model that the Hugging Face class of its type cannot express."""
    kind = model_type(model)
    qk_norm, qkv_bias = SWITCHES.get(kind, (False, False))
    cls, has = ARCHITECTURES[kind], {True: "has", False: "has no"}
    refuse = {
        "qk_norm": (model.qk_norm != qk_norm, f"{cls} {has[qk_norm]} QK-norm"),
        "qkv_bias": (model.qkv_bias != qkv_bias, f"{cls} {has[qkv_bias]} q/k/v biases"),
        "sliding_window": (model.sliding_window > 0 and kind not in WINDOWED, f"{cls} has none"),
    }
    if kind == "deepseek_v3":
        refuse |= {
            "router": (model.router != "sigmoid", f"{cls} routes by sigmoid"),
            "shared_experts": (model.shared_experts < 1, f"{cls} has shared experts"),
        }
    elif model.moe:  # what neither Mixtral nor Qwen3-MoE can express
        refuse |= {
            "shared_experts": (model.shared_experts > 0, "neither has shared experts"),
            "router": (model.router != "softmax", "both route by softmax"),
            "balance": (model.balance == "bias", "neither has a routing bias"),
            "n_group": (model.n_group > 1, "neither limits the experts to groups"),
            "routed_scaling": (model.routed_scaling != 1, "neither scales the routed weights"),
            "norm_topk_prob": (not model.norm_topk_prob, "tetrad writes them renormalised"),
            "dense_layers": (
                model.dense_layers > 0 and not model.qk_norm,
                "Mixtral has no dense layers (a QK-norm model exports as Qwen3-MoE, which has)",
            ),
        }
    target = "Mixtral or Qwen3-MoE" if model.family == "moe" else cls
    for field, (bad, why) in refuse.items():
        if bad:
            raise ValueError(
                f"model.{field}={getattr(model, field)!r} cannot be exported to Hugging Face "
                f"{target}: {why}"
            )


# what a model imported from Hugging Face keeps on the way out: its special tokens
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id")


def carried_over(source: str) -> dict[str, Any]:
    """Special-token ids of the directory a model was imported from (when still there)."""
    file = Path(source) / CONFIG if source else None
    if file is None or not file.is_file():
        return {}
    raw = json.loads(file.read_text())
    return {k: raw[k] for k in CARRIED if k in raw}


def save(
    state: dict[str, torch.Tensor],
    model: ModelConfig,
    out: str | Path,
    max_shard_bytes: int = 4 * 2**30,
    dtype: torch.dtype = torch.float32,
) -> list[Path]:
    """Write a Hugging Face Llama directory from full logical tensors; returns its files.

    Tensors are cut into shards of at most `max_shard_bytes` (a tensor larger than that gets
    a shard of its own), listed in model.safetensors.index.json when there is more than one.
    """
    check_exportable(model)
    check_routing_bias(state, model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in to_hf_state(state, model).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    for key, t in tensors.items():
        if shards[-1] and _nbytes(shards[-1]) + t.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][key] = t
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    for name, shard in zip(names, shards):
        save_file(shard, out / name, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": _nbytes(tensors)},
            "weight_map": {k: n for n, s in zip(names, shards) for k in s},
        }
        (out / INDEX).write_text(json.dumps(index, indent=2))
        names.append(INDEX)
    dtype_name = str(dtype).removeprefix("torch.")
    config = hf_config(model, dtype_name) | carried_over(model.init_from_hf)
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return [out / n for n in (*names, CONFIG)]


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())
