"""Token sources and the sharded, resumable batch loader.

The global batch of step k is a function of (seed, k) alone: changing the number of
steps, the layout or the resume point never changes what any step sees. Data rank r of d
takes sequences [r·B/d, (r+1)·B/d) of it, cut into microbatches. The loader's state is
the next step number.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

from tetrad.models.batch import IGNORE, Microbatch
from tetrad.models.init import name_seed


def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """Bytes of the running Python's standard-library sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise ValueError(f"no Python sources found under {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def load_path(path: str, max_bytes: int) -> np.ndarray:
    """A pre-tokenised .u16/.u32 file (memory-mapped), or text file(s) read as bytes."""
    p = Path(path)
    if p.suffix in (".u16", ".u32", ".bin"):
        dtype = np.uint32 if p.suffix == ".u32" else np.uint16
        return np.memmap(p, dtype=dtype, mode="r")
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    data = b"".join(f.read_bytes() for f in files)[:max_bytes]
    return np.frombuffer(data, dtype=np.uint8)


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
    """Random windows of a long token array; window i of step k depends on (seed, k, i)."""

    def __init__(self, tokens: np.ndarray, vocab: int, seed: int, name: str = "the data"):
        self.tokens, self.seed = tokens, seed
        check_ids(tokens, vocab, name)

    def sequence(self, step: int, index: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(
                f"corpus of {len(self.tokens)} tokens is too short for seq_len={seq_len}"
            )
        gen = np.random.default_rng(name_seed(self.seed, f"data:{step}:{index}"))
        start = int(gen.integers(0, len(self.tokens) - seq_len - 1))
        window = torch.from_numpy(np.asarray(self.tokens[start : start + seq_len + 1], np.int64))
        return window[:-1], window[1:]


class Synthetic:
    """Learnable synthetic sequences (arithmetic progressions with noise), variably padded."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed

    def sequence(self, step: int, index: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(name_seed(self.seed, f"synthetic:{step}:{index}"))
        start, stride = torch.randint(0, self.vocab, (2,), generator=gen).tolist()
        seq = (start + (stride % 7 + 1) * torch.arange(seq_len + 1)) % self.vocab
        noise = torch.rand(seq_len + 1, generator=gen) < 0.1
        seq[noise] = torch.randint(0, self.vocab, (int(noise.sum()),), generator=gen)
        inputs, targets = seq[:-1].clone(), seq[1:].clone()
        # a ragged end, so that "mean over real tokens" differs from "mean of means"
        length = int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=gen))
        inputs[length:], targets[length:] = 0, IGNORE
        return inputs, targets


class Loader:
    """This data rank's microbatches of each step."""

    def __init__(
        self,
        source,
        global_batch: int,
        seq_len: int,
        data_rank: int,
        data_ranks: int,
        microbatches: int,
    ):
        self.source, self.seq_len = source, seq_len
        self.global_batch, self.data_rank, self.data_ranks = global_batch, data_rank, data_ranks
        self.microbatches = microbatches
        self.step = 0

    @property
    def microbatch_size(self) -> int:
        return self.global_batch // (self.data_ranks * self.microbatches)

    def batch(self, step: int) -> list[Microbatch]:
        """Microbatches of `step` for this data rank."""
        per_rank = self.global_batch // self.data_ranks
        first = self.data_rank * per_rank
        seqs = [self.source.sequence(step, first + i, self.seq_len) for i in range(per_rank)]
        b = self.microbatch_size
        return [
            Microbatch(
                torch.stack([s[0] for s in seqs[j : j + b]]),
                torch.stack([s[1] for s in seqs[j : j + b]]),
            )
            for j in range(0, per_rank, b)
        ]

    def next(self) -> list[Microbatch]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def make_source(source: str, vocab: int, seed: int, max_bytes: int):
    """`synthetic`, `stdlib` or a path -> an object with `sequence(step, index, seq_len)`."""
    if source == "synthetic":
        return Synthetic(vocab, seed)
    tokens = stdlib_corpus(max_bytes) if source == "stdlib" else load_path(source, max_bytes)
    return TokenStream(tokens, vocab, seed, "the stdlib corpus" if source == "stdlib" else source)
