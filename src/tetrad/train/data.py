"""Token sources and the sharded, resumable batch loader.

The global batch of step k is a function of (seed, k) alone: changing the number of
steps, the layout or the resume point never changes what any step sees. Data rank r of d
takes sequences [r·B/d, (r+1)·B/d) of it, cut into microbatches. The loader's state is
the next step number.
"""

from __future__ import annotations

import copy
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tetrad.config import Config
from tetrad.interop.tokenizer import check_token_file, check_vocab, encode, encode_text
from tetrad.models.batch import IGNORE, Microbatch
from tetrad.models.init import name_seed
from tetrad.parallel.context import split_sequence


def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """Bytes of the running Python's standard-library sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if not chunks:
        raise ValueError(f"no Python sources found under {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


# token files by suffix: `tetrad data prepare`'s, and nanoGPT's train.bin (uint16 ids)
TOKEN_FILES = {".u16": np.uint16, ".u32": np.uint32, ".bin": np.uint16}


def load_path(path: str, max_bytes: int) -> np.ndarray:
    """A pre-tokenised .u16/.u32/.bin file (memory-mapped), or text file(s) read as bytes."""
    p = Path(path)
    if p.suffix in TOKEN_FILES:
        return token_file(p, np.dtype(TOKEN_FILES[p.suffix]))
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    data = b"".join(f.read_bytes() for f in files)[:max_bytes]
    return np.frombuffer(data, dtype=np.uint8)


def token_file(path: Path, dtype: np.dtype) -> np.memmap:
    """The token ids of `path`, memory-mapped, or a ValueError naming the file if its size
    cannot hold whole ids of `dtype` (numpy's own error names no file). Every rank opens
    the file before the first collective, so a truncated file fails every rank alike."""
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ValueError(
            f"token file {path} is {size} bytes, not a positive multiple of {dtype.itemsize}, "
            f"the size of one {dtype.name} token id its suffix {path.suffix} implies: a "
            "truncated file, or one written with another dtype"
        )
    return np.memmap(path, dtype=dtype, mode="r")


CHECK_CHUNK = 1 << 24  # tokens per vectorised pass: 32-64 MiB of a memory-mapped file


def check_ids(tokens: np.ndarray, vocab: int, name: str) -> None:
    """Every token id < vocab, or a ValueError naming the first bad one and its position.

    Vectorised in chunks over the (memory-mapped) array: every rank checks the whole file
    when it opens it, so a bad id fails the job at start on every rank alike, never one
    rank mid-run."""
    for start in range(0, len(tokens), CHECK_CHUNK):
        chunk = np.asarray(tokens[start : start + CHECK_CHUNK])
        if int(chunk.max()) >= vocab:
            at = int(np.argmax(chunk >= vocab))
            raise ValueError(
                f"token id {int(chunk[at])} at position {start + at} of {name} is >= "
                f"model.vocab={vocab}"
            )


class TokenStream:
    """A long token array read in epochs: shuffled passes over fixed windows, no repetition.
    Every target is a token (`padded` False: the trainer needs no count of them).

    Window w is tokens [w·s, w·s + s + 1) (s = seq_len). Sequence `index` of step k is the
    global sequence g = k·B + index; it is window order(epoch)[g mod n] of epoch g div n,
    with `order` a permutation of the n training windows drawn from (seed, epoch). So what
    a step sees is a function of (seed, k) alone: a resumed run continues the same pass,
    and a changed data-parallel degree re-deals the same sequences. The last `heldout`
    windows (after a one-token gap) are in no epoch: they are the evaluation split
    (`heldout_split`).
    """

    padded = False  # whether some targets are IGNORE (`Trainer._token_count`)

    def __init__(
        self,
        tokens: np.ndarray,
        vocab: int,
        seed: int,
        global_batch: int,
        seq_len: int,
        heldout: int = 0,
        name: str = "the data",
    ):
        self.tokens, self.seed = tokens, seed
        self.global_batch, self.seq_len, self.heldout = global_batch, seq_len, heldout
        check_ids(tokens, vocab, name)
        # training windows end before the held-out ones begin: no token is in both
        self.eval_start = len(tokens) - heldout * seq_len - 1 if heldout else len(tokens)
        self.windows = max(0, (self.eval_start - 1) // seq_len)
        if self.windows < 1:
            held = f" and {heldout} held-out sequences" if heldout else ""
            raise ValueError(
                f"corpus of {len(tokens)} tokens is too short for seq_len={seq_len}{held}"
            )
        self._order: tuple[int, np.ndarray] | None = None
        self.evaluating = False  # the held-out split's view (`heldout_split`)

    def epochs(self, steps: int) -> float:
        """Passes over the training windows made by the first `steps` steps."""
        return steps * self.global_batch / self.windows

    def order(self, epoch: int) -> np.ndarray:
        """The training windows in epoch `epoch`'s order (the current epoch's is kept)."""
        if self._order is None or self._order[0] != epoch:
            gen = np.random.default_rng(name_seed(self.seed, f"epoch:{epoch}"))
            self._order = (epoch, gen.permutation(self.windows))
        return self._order[1]

    def sequence(self, step: int, index: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len != self.seq_len:
            raise ValueError(f"windows of {self.seq_len} tokens cut, {seq_len} asked for")
        g = step * self.global_batch + index
        if self.evaluating:
            start = self.eval_start + g % self.heldout * seq_len
        else:
            epoch, position = divmod(g, self.windows)
            start = int(self.order(epoch)[position]) * seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start : start + seq_len + 1], np.int64))
        return window[:-1], window[1:]

    def heldout_split(self) -> TokenStream:
        """The evaluation split: the last windows, in order (batch k holds sequences k·B to
        (k+1)·B - 1, wrapping around)."""
        if not self.heldout:
            raise ValueError("no held-out windows were set aside")
        split = copy.copy(self)
        split.evaluating = True
        return split


class Synthetic:
    """Learnable synthetic sequences (arithmetic progressions with noise), variably padded."""

    padded = True  # whether some targets are IGNORE (`Trainer._token_count`)

    def __init__(self, vocab: int, seed: int, split: str = "synthetic"):
        self.vocab, self.seed, self.split = vocab, seed, split

    def heldout_split(self) -> Synthetic:
        """Sequences drawn under another name: never the ones training sees."""
        return Synthetic(self.vocab, self.seed, "synthetic-heldout")

    def sequence(self, step: int, index: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(name_seed(self.seed, f"{self.split}:{step}:{index}"))
        start, stride = torch.randint(0, self.vocab, (2,), generator=gen).tolist()
        seq = (start + (stride % 7 + 1) * torch.arange(seq_len + 1)) % self.vocab
        noise = torch.rand(seq_len + 1, generator=gen) < 0.1
        seq[noise] = torch.randint(0, self.vocab, (int(noise.sum()),), generator=gen)
        inputs, targets = seq[:-1].clone(), seq[1:].clone()
        # a ragged end, so that "mean over real tokens" differs from "mean of means"
        length = int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=gen))
        inputs[length:], targets[length:] = 0, IGNORE
        return inputs, targets


@dataclass
class Loader:
    """This data rank's microbatches of each step: whole sequences, or (context
    parallelism) this cp rank's two chunks of each, tokens and targets alike."""

    source: Any
    global_batch: int
    seq_len: int
    data_rank: int
    data_ranks: int
    microbatches: int
    cp_rank: int = 0
    cp: int = 1
    step: int = 0  # the next step's number: the loader's whole state

    def batch(self, step: int) -> list[Microbatch]:
        """Microbatches of `step` for this data rank."""
        per_rank = self.global_batch // self.data_ranks
        first = self.data_rank * per_rank
        seqs = [self.source.sequence(step, first + i, self.seq_len) for i in range(per_rank)]
        # [b, S] -> this cp rank's [b, S/cp] (its token count is then its own share)
        inputs, targets = (
            split_sequence(torch.stack(x), self.cp, self.cp_rank) for x in zip(*seqs)
        )
        b = per_rank // self.microbatches
        return [Microbatch(i, t) for i, t in zip(inputs.split(b), targets.split(b))]

    def next(self) -> list[Microbatch]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def make_source(
    source: str,
    vocab: int,
    seed: int,
    max_bytes: int,
    global_batch: int,
    seq_len: int,
    heldout: int = 0,
    tokenizer: str = "",
):
    """`synthetic`, `stdlib` or a path -> an object with `sequence(step, index, seq_len)`
    (and `heldout_split()`). Text is read as bytes, or through `tokenizer` when given;
    a token file is read as ids (a prepared one checked against its sidecar first)."""
    if source == "synthetic":
        return Synthetic(vocab, seed)
    if tokenizer:
        check_vocab(tokenizer, vocab)
    if source == "stdlib" and tokenizer:
        tokens = encode([stdlib_corpus(max_bytes).tobytes().decode("utf-8", "replace")], tokenizer)
    elif source == "stdlib":
        tokens = stdlib_corpus(max_bytes)
    elif Path(source).suffix in TOKEN_FILES:  # ids, with or without a tokenizer
        tokens = load_path(source, max_bytes)  # a ragged file fails here, by name
        check_token_file(source, vocab, tokenizer)
    elif tokenizer:
        tokens = encode_text(source, tokenizer, max_bytes)
    else:
        tokens = load_path(source, max_bytes)
    name = "the stdlib corpus" if source == "stdlib" else source
    return TokenStream(tokens, vocab, seed, global_batch, seq_len, heldout, name)


def source_of(cfg: Config, heldout: int = 0):
    """The data source a configuration names (`heldout` windows set aside for evaluation)."""
    t, d = cfg.train, cfg.data
    return make_source(
        d.source, cfg.model.vocab, t.seed, d.max_bytes, t.global_batch, t.seq_len, heldout,
        d.tokenizer,
    )  # fmt: skip
