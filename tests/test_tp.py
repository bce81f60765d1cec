"""Tensor (and sequence) parallelism reproduces the single process and moves Megatron's bytes."""

from __future__ import annotations

import pytest

from harness import Jobs, assert_close_run, one_step_comm, tiny_config
from tetrad.layout import Layout

# Layouts by world size, each group trained in one set of processes: name -> (parallel,
# model overrides). kv_heads=2 is == tp at tp=2 and < tp at tp=4 (each kv head replicated
# on two ranks); vocab 63 and 66 do not divide by tp (the last vocab shard is short).
# 8 steps: a wrong split, sum or gather is off from the first step; 8 AdamW steps carry
# the optimizer state past its warm-up
TRAIN = {"steps": 8}
LAYOUTS = {
    2: {
        "tp2": ({"tp": 2}, {}),
        "tp2-sp-v63": ({"tp": 2, "sp": True}, {"vocab": 63}),
        "tp2-sp-tied": ({"tp": 2, "sp": True}, {"tie_embeddings": True}),
    },
    4: {
        "tp4-kv<tp-v66": ({"tp": 4}, {"vocab": 66}),
        "tp4-sp-kv<tp-v66": ({"tp": 4, "sp": True}, {"vocab": 66}),
        "tp4-sp-kv=tp": ({"tp": 4, "sp": True}, {"kv_heads": 4}),
        "dp2xtp2-sp-mb2": ({"dp": 2, "tp": 2, "sp": True, "microbatches": 2}, {}),
        "dp2xtp2": ({"dp": 2, "tp": 2}, {}),
    },
}


# the comm test's configs: whole kv heads per rank (no weight gathers), 1 and 2 layers
COMM_T, COMM_MB, COMM_H = 4, 2, 32
COMM = [
    tiny_config(
        model={"heads": 4, "kv_heads": 4, "dim": COMM_H, "layers": layers},
        parallel={"tp": COMM_T, "sp": sp, "microbatches": COMM_MB},
        train={"dtype": "fp32"},  # Megatron's bytes as users move them: fp32
    )
    for sp in (False, True)
    for layers in (1, 2)
]
# the 2-layer SP step again in bf16 compute, its gradients reduced in fp32, then in bf16
COMM_BF16 = [
    tiny_config(
        model={"heads": 4, "kv_heads": 4, "dim": COMM_H, "layers": 2},
        parallel={"tp": COMM_T, "sp": True, "microbatches": COMM_MB, "reduce_dtype": reduce},
        train={"dtype": "bf16"},
    )
    for reduce in ("fp32", "bf16")
]


def declare_jobs(jobs: Jobs) -> None:
    """The layouts of 2 and of 4 ranks, and the comm-volume step (4)."""
    for world, cases in LAYOUTS.items():
        cfgs = [
            tiny_config(parallel=par, model=model, train=TRAIN) for par, model in cases.values()
        ]
        jobs.add_training(f"layouts{world}", cfgs)
    jobs.add("comm", COMM_T, one_step_comm, [c.to_dict() for c in COMM + COMM_BF16])


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_tp_matches_single_process(reference, jobs, world):
    cases = LAYOUTS[world]
    runs = jobs[f"layouts{world}"][0]
    failed = []
    for (name, (par, model)), got in zip(cases.items(), runs, strict=True):
        ref = reference(
            model=model, parallel={"microbatches": par.get("microbatches", 1)}, train=TRAIN
        )
        try:
            assert_close_run(got, ref)
        except AssertionError as e:
            failed.append(f"{name}: {e}")
    assert not failed, "\n".join(failed)


def _bus(summary: dict, *ops: str) -> float:
    return sum(summary.get(f"tp/{op}", {}).get("bus_bytes", 0.0) for op in ops)


def _calls(summary: dict, op: str) -> int:
    return summary.get(f"tp/{op}", {}).get("calls", 0)


@pytest.mark.distributed
def test_tp_comm_volume_per_layer_is_megatron(jobs):
    """Per layer per microbatch: 8·b·s·h·(t-1)/t elements on the bus, with SP or without.

    The per-layer share is the difference between a 2-layer and a 1-layer model (the
    embedding and the vocabulary-parallel loss have collectives of their own).
    """
    t, mb, h = COMM_T, COMM_MB, COMM_H
    plain1, plain2, sp1, sp2, *_ = jobs["comm"][0]
    b, s = Layout.build(COMM[0]).microbatch_size, COMM[0].train.seq_len
    megatron = 8 * b * s * h * (t - 1) / t * 4 * mb  # fp32 bytes per layer per step

    assert _bus(plain2, "all_reduce") - _bus(plain1, "all_reduce") == pytest.approx(megatron)
    assert _calls(plain2, "all_reduce") - _calls(plain1, "all_reduce") == 4 * mb
    for op in ("all_gather", "reduce_scatter"):
        assert _calls(plain2, op) == _calls(plain1, op)

    moved = _bus(sp2, "all_gather", "reduce_scatter") - _bus(sp1, "all_gather", "reduce_scatter")
    assert moved == pytest.approx(megatron)
    for op in ("all_gather", "reduce_scatter"):  # two forward, two as backward's transposes
        assert _calls(sp2, op) - _calls(sp1, op) == 4 * mb
    # besides: the two norm weights' gradients, summed over tp (h elements each)
    norm_grads = 2 * h * 4 * 2 * (t - 1) / t * mb
    assert _bus(sp2, "all_reduce") - _bus(sp1, "all_reduce") == pytest.approx(norm_grads)


@pytest.mark.distributed
def test_sp_norm_gradients_are_summed_in_the_reduce_dtype(jobs):
    """Under bf16 compute, the SP norm weights' gradients cross tp in `reduce_dtype`: fp32
    by default (the fp32 run's bytes exactly), bf16 when asked (half of theirs). Every
    other tp all-reduce (the loss's statistics) is fp32 either way."""
    t, mb, h = COMM_T, COMM_MB, COMM_H
    sp2, bf16_fp32, bf16_bf16 = (jobs["comm"][0][i] for i in (3, 4, 5))
    norms = 2 * 2 + 1  # two per block, and the final norm
    norm_grads = norms * h * 4 * 2 * (t - 1) / t * mb  # fp32 bytes on the bus per step
    assert _bus(bf16_fp32, "all_reduce") == pytest.approx(_bus(sp2, "all_reduce"))
    assert _bus(bf16_fp32, "all_reduce") - _bus(bf16_bf16, "all_reduce") == pytest.approx(
        norm_grads / 2
    )


@pytest.mark.parametrize(
    "model,parallel,train,match",
    [
        ({"heads": 4, "kv_heads": 2}, {"tp": 3}, {}, "heads=4 is not divisible by tp=3"),
        ({"dim": 48, "heads": 12, "kv_heads": 3}, {"tp": 4}, {}, "kv_heads=3 and tp=4"),
        ({"dim": 64, "heads": 8, "kv_heads": 8, "ffn_dim": 100}, {"tp": 8}, {}, "100"),
        ({}, {"tp": 4, "sp": True}, {"seq_len": 18}, "seq_len=18, tp=4"),
        ({}, {"sp": True}, {}, "sp=True needs tp > 1"),
    ],
    ids=["heads", "kv-heads", "ffn-hidden", "sp-seq-len", "sp-without-tp"],
)
def test_bad_tp_layouts_raise(model, parallel, train, match):
    cfg = tiny_config(model=model, parallel=parallel, train=train)
    with pytest.raises(ValueError, match=match):
        Layout.build(cfg, cfg.parallel.world)
