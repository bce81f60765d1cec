"""Real tokenizers: a local `tokenizer.json` through Hugging Face `tokenizers`.

`tetrad data prepare` writes a token file once (`.u16` when the vocabulary fits 16 bits,
else `.u32`), memory-mapped by training, with a JSON sidecar (`FILE.json`): the
tokenizer's sha256, its vocabulary size and the token count. Training checks the sidecar
against the model and the `--tokenizer` it is given, so a file made with another tokenizer
fails before the first step instead of training on the wrong ids.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

SIDECAR_FORMAT = "tetrad-tokens"
TOKEN_SUFFIXES = {".u16": np.uint16, ".u32": np.uint32}


# the vocabulary a tokenizer sets is padded to a multiple of this (times tp), as Megatron's
# --make-vocab-size-divisible-by: no token has a padded id, so training pushes their logits down
VOCAB_MULTIPLE = 128


def load(path: str | Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json (or a directory holding one)."""
    p = tokenizer_file(path)
    if not p.is_file():
        raise ValueError(f"tokenizer {p}: no such file")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ValueError(
            "--tokenizer needs the tokenizers package: pip install 'tetrad[tokenizers]'"
        ) from e
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises its own exception type for bad JSON
        raise ValueError(f"tokenizer {p} is unreadable: {e}") from e


def tokenizer_file(path: str | Path) -> Path:
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def sha256(path: str | Path) -> str:
    return hashlib.sha256(tokenizer_file(path).read_bytes()).hexdigest()


def vocab_size(tokenizer) -> int:
    """Ids the tokenizer can emit: its vocabulary with the added tokens."""
    return tokenizer.get_vocab_size(with_added_tokens=True)


def check_vocab(path: str | Path, model_vocab: int) -> None:
    """The tokenizer's ids fit the model's embedding."""
    size = vocab_size(load(path))
    if size > model_vocab:
        raise ValueError(
            f"tokenizer {tokenizer_file(path)} has {size} tokens, more than model.vocab="
            f"{model_vocab}"
        )


def encode_text(path: str | Path, tokenizer_path: str | Path, max_bytes: int = 0) -> np.ndarray:
    """Token ids of a text file (or of every file under a folder, in name order)."""
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    texts, read = [], 0
    for f in files:
        texts.append(f.read_text(encoding="utf-8", errors="replace"))
        read += len(texts[-1])
        if max_bytes and read >= max_bytes:
            break
    return encode(texts, tokenizer_path)


def encode(texts: list[str], tokenizer_path: str | Path) -> np.ndarray:
    """Token ids of texts, one after the other (no special tokens added)."""
    tok = load(tokenizer_path)
    ids: list[np.ndarray] = []
    for text in texts:
        # a batch of lines at a time keeps memory flat and lets tokenizers use its threads
        lines = text.splitlines(keepends=True)
        for i in range(0, len(lines), 4096):
            for enc in tok.encode_batch(lines[i : i + 4096], add_special_tokens=False):
                ids.append(np.asarray(enc.ids, dtype=np.int64))
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)


def prepare(text: str | Path, tokenizer_path: str | Path, out: str | Path) -> dict[str, Any]:
    """Tokenise `text` into the token file `out` (.u16 or .u32) and its sidecar."""
    out = Path(out)
    if out.suffix not in TOKEN_SUFFIXES:
        raise ValueError(f"--out {out}: the name must end in .u16 or .u32")
    if not Path(text).exists():
        raise ValueError(f"{text}: no such file or directory")
    size = vocab_size(load(tokenizer_path))
    dtype = TOKEN_SUFFIXES[out.suffix]
    if size > np.iinfo(dtype).max + 1:
        raise ValueError(f"tokenizer vocabulary {size} does not fit {out.suffix}; use .u32")
    ids = encode_text(text, tokenizer_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    ids.astype(dtype).tofile(out)
    info = {
        "format": SIDECAR_FORMAT,
        "tokenizer": str(tokenizer_file(tokenizer_path)),
        "tokenizer_sha256": sha256(tokenizer_path),
        "vocab_size": size,
        "tokens": int(len(ids)),
        "dtype": out.suffix[1:],
        "source": str(text),
    }
    sidecar(out).write_text(json.dumps(info, indent=1))
    return info


def sidecar(token_file: str | Path) -> Path:
    return Path(f"{token_file}.json")


def data_vocab(source: str, tokenizer_path: str = "") -> int | None:
    """Ids the data can hold: the tokenizer's vocabulary, or the one a prepared token
    file's sidecar records; None for bytes and synthetic data (the model's own vocab)."""
    if tokenizer_path:
        return vocab_size(load(tokenizer_path))
    side = sidecar(source)
    if Path(source).suffix in TOKEN_SUFFIXES and side.is_file():
        try:
            return int(json.loads(side.read_text())["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"token file sidecar {side} is unreadable: {e}") from e
    return None


def padded_vocab(size: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """`size` rounded up to a multiple of `multiple`·tp: the head's matmul keeps an
    efficient shape and the vocabulary splits evenly over the tp ranks."""
    step = multiple * tp
    return -(-size // step) * step


def check_token_file(path: str | Path, model_vocab: int, tokenizer_path: str = "") -> None:
    """A prepared token file fits the model and was made with the given tokenizer."""
    side = sidecar(path)
    if not side.is_file() or Path(path).suffix not in TOKEN_SUFFIXES:
        return  # a token file from elsewhere: only its ids are checked, by the loader
    try:
        info = json.loads(side.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"token file sidecar {side} is unreadable: {e}") from e
    if info.get("vocab_size", 0) > model_vocab:
        raise ValueError(
            f"{path} was made with a tokenizer of {info['vocab_size']} tokens "
            f"({info.get('tokenizer')}), more than model.vocab={model_vocab}"
        )
    tokens = Path(path).stat().st_size // np.dtype(TOKEN_SUFFIXES[Path(path).suffix]).itemsize
    if info.get("tokens") != tokens:
        raise ValueError(f"{path} holds {tokens} tokens but {side} says {info.get('tokens')}")
    if tokenizer_path and info.get("tokenizer_sha256") != sha256(tokenizer_path):
        raise ValueError(
            f"{path} was made with tokenizer {info.get('tokenizer')} (sha256 "
            f"{str(info.get('tokenizer_sha256'))[:12]}...), not with --tokenizer "
            f"{tokenizer_file(tokenizer_path)} (sha256 {sha256(tokenizer_path)[:12]}...)"
        )


def export_tokenizer(path: str | Path, out_dir: str | Path, max_len: int) -> list[Path]:
    """Copy the run's tokenizer beside an exported model, as transformers reads it."""
    src = tokenizer_file(path)
    if not src.is_file():
        raise ValueError(f"the run's tokenizer {src} is gone; the weights were exported without it")
    out = Path(out_dir)
    shutil.copyfile(src, out / "tokenizer.json")
    names = ["tokenizer_config.json", "special_tokens_map.json"]
    if (src.parent / names[0]).is_file():  # a Hugging Face tokenizer's own settings
        names = [n for n in names if (src.parent / n).is_file()]  # (special tokens, template)
        for name in names:
            shutil.copyfile(src.parent / name, out / name)
    else:
        names = names[:1]
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
        (out / names[0]).write_text(json.dumps(settings, indent=2))
    return [out / n for n in ("tokenizer.json", *names)]
