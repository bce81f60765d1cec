"""`tetrad generate`: sample from a checkpoint on one process, as a check that it learned.

The run's tokenizer (or bytes, when it had none) encodes the prompt and decodes the
answer. No key-value cache: each new token re-reads the whole window, which is plenty for
a sanity check on a small model and keeps the model code the training code.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tetrad.models.families import spec_for
from tetrad.train.checkpoint import load_model


def generate(
    run: str | Path,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> str:
    """The prompt's continuation by the newest checkpoint of `run` (or checkpoint `run`):
    greedy when temperature is 0, else sampled (from the top_k most likely, if > 0)."""
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    cfg, state = load_model(run, buffers=True)
    model = spec_for(cfg.model).build(cfg.model).to_empty(device="cpu")
    model.load_state_dict(state)
    model.eval()
    encode, decode = _codec(cfg.data.tokenizer)
    ids = encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty after tokenisation")
    if max(ids) >= cfg.model.vocab:
        raise ValueError(f"prompt token id {max(ids)} >= model.vocab={cfg.model.vocab}")
    window = min(cfg.model.max_seq_len, cfg.train.seq_len)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            context = torch.tensor([(ids + out)[-window:]])
            logits = model(context)[0, -1].float()
            out.append(_pick(logits, temperature, top_k, gen))
    return decode(out)


def _pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    if top_k > 0:
        cut = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < cut, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def _codec(tokenizer: str):
    """(encode, decode) of the run's text: its tokenizer, or UTF-8 bytes."""
    if not tokenizer:
        return (lambda text: list(text.encode("utf-8"))), (
            lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace")
        )
    from tetrad.interop.tokenizer import load

    tok = load(tokenizer)
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode
