"""The planner orders layouts of one model on one cluster as published measurements do;
no processes.

- The zero-bubble paper (Qi et al. 2023, Tables 4 and 6, `zero_bubble_throughput.csv`):
  GPT models of 1.5B to 28.3B on 8 to 32 A100s, pure pipeline parallelism, 1F1B and
  ZB-1p (tetrad's zb-h1) at three microbatch counts each: seven groups of six measured
  layouts. (ZB-2p and ZB-V with one layer a chunk, and 1F1B-I with one layer a chunk,
  are schedules or splits tetrad does not run.)
- torchtitan's Llama 3.1 405B on 512 H100s (Table 5 of its Dec 2024 benchmark,
  `torchtitan_bench.csv`): the interleaved schedule over 1F1B at fsdp 8, tp 8, pp 8.
"""

from __future__ import annotations

import csv
import itertools

import pytest

from harness import reference_csv
from plan_helpers import layout_config, planned
from plan_published import LLAMA31_405B
from tetrad.plan.candidates import gpt_as_llama
from tetrad.plan.cost import Planner
from tetrad.plan.engines import ENGINES
from tetrad.plan.hardware import cluster_preset

SCHEDULES = {"1F1B": "1f1b", "ZB-1p": "zb-h1"}
CLOSE = 0.03  # measured throughputs closer than this are not held to an order


def _zero_bubble_groups() -> dict[tuple, list[tuple[str, int, float, float]]]:
    """(table, layers, p, microbatch) -> [(schedule, m, measured, predicted samples/s/GPU)]."""
    planner = Planner(cluster_preset("a100"))
    groups: dict[tuple, list] = {}
    with open(reference_csv("zero_bubble_throughput.csv")) as fh:
        rows = [r for r in csv.DictReader(fh) if r["schedule"] in SCHEDULES]
    for r in rows:
        keys = ("num_layers", "attention_heads", "hidden_size", "seq_len", "pp_stages_gpus",
                "microbatch_size", "num_microbatches")  # fmt: skip
        layers, heads, hidden, seq, p, b, m = (int(r[k]) for k in keys)
        model = gpt_as_llama(layers, hidden, heads, 50304, seq)  # GPT-2's vocab, assumed
        cfg = layout_config(model, b * m, seq, pp=p, pp_schedule=SCHEDULES[r["schedule"]],
                            microbatches=m)  # fmt: skip
        step = planner.predict(*planned(cfg), detail=False).step_time_s
        groups.setdefault((r["table"], layers, p, b), []).append(
            (r["schedule"], m, float(r["samples_per_gpu_per_s"]), b * m / step / p)
        )
    return groups


def test_zero_bubble_layouts_ranked_as_measured():
    """In every group the planner's fastest is the measured fastest, and every pair of
    layouts whose measured throughputs differ by more than 3% is ordered as measured
    (103 of the 105 pairs agree; the two that do not were measured 0.7% and 2.3% apart)."""
    groups = _zero_bubble_groups()
    assert len(groups) == 7 and all(len(g) == 6 for g in groups.values())
    agree = pairs = 0
    for key, layouts in groups.items():
        best = max(layouts, key=lambda x: x[2])
        assert max(layouts, key=lambda x: x[3]) == best, key
        for a, b in itertools.combinations(layouts, 2):
            pairs += 1
            same = (a[2] < b[2]) == (a[3] < b[3])
            agree += same
            if abs(a[2] / b[2] - 1) > CLOSE:
                assert same, (key, a, b)
    assert agree >= 0.95 * pairs, (agree, pairs)


@pytest.mark.parametrize("microbatches", [8, 32])
def test_torchtitan_405b_interleaved_over_1f1b(microbatches):
    """torchtitan Table 5: Llama 3.1 405B on 512 H100s (fsdp 8, tp 8, pp 8, full
    recompute, global batch 256), interleaved 128 tokens/s a GPU against 1F1B's 100.
    The published runs are float8, which the planner does not model: the order is
    checked, not the figures."""
    planner = Planner(cluster_preset("h100-hbm2e"), ENGINES["torchtitan-async-tp"], "full")
    tokens = {}
    m = microbatches
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        cfg = layout_config(LLAMA31_405B, 256, 8192, fsdp=8, tp=8, pp=8, sp=True,
                            pp_schedule=name, virtual_stages=v, microbatches=m)  # fmt: skip
        tokens[name] = planner.predict(*planned(cfg), detail=False).tokens_per_s
    assert tokens["interleaved-1f1b"] > tokens["1f1b"]
