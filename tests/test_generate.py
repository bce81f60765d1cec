"""`tetrad generate`'s decoding: greedy at temperature 0, else seeded sampling from the top
k and top p (no processes, no checkpoint: a tiny model built in place)."""

from __future__ import annotations

import math

import pytest
import torch

from tetrad.cli import main as cli_main
from tetrad.cli import parser
from tetrad.config import ModelConfig
from tetrad.generate import Sampling, continue_ids
from tetrad.models.init import build_model

CFG = ModelConfig(name="tiny", layers=2, dim=32, heads=4, kv_heads=2, vocab=64)
PROMPT, WINDOW = [5, 9, 2], 8


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=3).eval()


def test_greedy_at_temperature_zero_is_argmax_decoding(model):
    want: list[int] = []
    with torch.no_grad():
        for _ in range(6):
            context = torch.tensor([(PROMPT + want)[-WINDOW:]])
            want.append(int(model(context)[0, -1].argmax()))
    greedy = Sampling(temperature=0)
    assert continue_ids(model, PROMPT, 6, WINDOW, greedy, seed=0) == want
    assert continue_ids(model, PROMPT, 6, WINDOW, greedy, seed=1) == want  # no draws


def test_sampling_with_a_seed_is_reproducible(model):
    runs = [continue_ids(model, PROMPT, 8, WINDOW, Sampling(), seed) for seed in (7, 7, 8, 9)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs}) > 1  # it does sample: other seeds, other text


def draws(sampling: Sampling, logits: torch.Tensor, n: int = 400) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    return {sampling.pick(logits, gen) for _ in range(n)}


def test_top_k_restricts_to_the_k_most_likely():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1))
    top = set(torch.topk(logits, 5).indices.tolist())
    # hot enough to be near-uniform: any token outside the top 5 would show up
    assert draws(Sampling(temperature=50.0, top_k=5, top_p=1.0), logits) == top
    assert draws(Sampling(temperature=1.0, top_k=1), logits) == {int(logits.argmax())}


def test_top_p_keeps_the_fewest_most_likely_reaching_p():
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    assert draws(Sampling(temperature=1.0, top_k=0, top_p=0.7), logits) == {1, 3}
    assert draws(Sampling(temperature=1.0, top_k=0, top_p=0.4), logits) == {1}
    assert draws(Sampling(temperature=1.0, top_k=0, top_p=1.0), logits) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "bad,named",
    [
        ({"temperature": -0.5}, "--temperature must be >= 0, got -0.5"),
        ({"temperature": math.nan}, "--temperature must be >= 0, got nan"),
        ({"top_k": -1}, "--top-k must be >= 0 (0: no limit), got -1"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1] (1: no limit), got 0.0"),
        ({"top_p": 1.5}, "--top-p must be in (0, 1] (1: no limit), got 1.5"),
    ],
)
def test_bad_sampling_values_are_refused_by_name(bad, named):
    with pytest.raises(ValueError) as err:
        Sampling(**bad)
    assert str(err.value) == named


def test_cli_flags_default_to_sampling_and_refuse_bad_values_first(tmp_path, capsys):
    args = parser().parse_args(["generate", "run", "--prompt", "x"])
    d = Sampling()
    assert (args.temperature, args.top_k, args.top_p, args.seed) == (
        d.temperature, d.top_k, d.top_p, 0,
    )  # fmt: skip
    assert d.temperature > 0 and d.top_k > 0 and 0 < d.top_p < 1  # sampled by default
    gen_help = parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for said in (f"default {d.temperature}", f"default {d.top_k}", f"default {d.top_p}"):
        assert said in " ".join(gen_help.split())
    # the values are checked before any checkpoint is read (there is none here)
    missing = str(tmp_path / "no-run")
    assert cli_main(["generate", missing, "--prompt", "x", "--top-p", "1.5"]) == 2
    assert "--top-p must be in (0, 1] (1: no limit), got 1.5" in capsys.readouterr().err
