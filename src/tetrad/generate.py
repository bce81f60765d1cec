"""`tetrad generate`: sample from a checkpoint on one process, as a check that it learned.

The run's tokenizer (or bytes, when it had none) encodes the prompt and decodes the
answer. No key-value cache: each new token re-reads the whole window, which is plenty for
a sanity check on a small model and keeps the model code the training code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tetrad.models.families import spec_for
from tetrad.train.checkpoint import load_model


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the model's logits. Sampled by default: greedy
    decoding of a small, briefly trained model repeats its most frequent token ("the the
    the"). temperature 0 is greedy (argmax; top_k and top_p then play no part)."""

    temperature: float = 0.8  # the logits are divided by it
    top_k: int = 50  # only the k most likely tokens are drawn from (0: all)
    top_p: float = 0.95  # only the fewest most likely whose probabilities reach p (1: all)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # NaN included
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1: no limit), got {self.top_p}")

    def pick(self, logits: torch.Tensor, gen: torch.Generator) -> int:
        """The next token id from `logits` [vocab]: argmax, or a draw from the
        temperature-scaled softmax restricted to the top k, then to the top p of it."""
        if self.temperature == 0:
            return int(logits.argmax())
        logits = logits.float() / self.temperature
        if 0 < self.top_k < logits.numel():
            top = torch.topk(logits, self.top_k)  # exactly k, ties broken by topk
            logits = torch.full_like(logits, float("-inf")).scatter(0, top.indices, top.values)
        if self.top_p < 1:
            probs, order = torch.sort(torch.softmax(logits, dim=-1), descending=True)
            before = probs.cumsum(dim=0) - probs  # the mass of the likelier tokens
            logits[order[before >= self.top_p]] = float("-inf")  # the most likely stays
        return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))


def generate(
    run: str | Path, prompt: str, max_new_tokens: int, sampling: Sampling, seed: int
) -> str:
    """The prompt's continuation by the newest checkpoint of `run` (or checkpoint `run`),
    drawn as `sampling` says; the same seed gives the same text."""
    cfg, state = load_model(run, buffers=True)
    model = spec_for(cfg.model).build(cfg.model).to_empty(device="cpu").eval()
    model.load_state_dict(state)
    encode, decode = _codec(cfg.data.tokenizer)
    ids = encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty after tokenisation")
    if max(ids) >= cfg.model.vocab:
        raise ValueError(f"prompt token id {max(ids)} >= model.vocab={cfg.model.vocab}")
    window = min(cfg.model.max_seq_len, cfg.train.seq_len)
    return decode(continue_ids(model, ids, max_new_tokens, window, sampling, seed))


@torch.no_grad()
def continue_ids(
    model: nn.Module, ids: list[int], n: int, window: int, sampling: Sampling, seed: int
) -> list[int]:
    """`n` token ids after `ids`, each from the model's logits over the last `window`."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(n):
        context = torch.tensor([(ids + out)[-window:]])
        out.append(sampling.pick(model(context)[0, -1].float(), gen))
    return out


def _codec(tokenizer: str):
    """(encode, decode) of the run's text: its tokenizer, or UTF-8 bytes."""
    if not tokenizer:
        return (lambda text: list(text.encode("utf-8"))), (
            lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace")
        )
    from tetrad.interop.tokenizer import load

    tok = load(tokenizer)
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode
