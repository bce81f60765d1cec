"""Context parallelism reproduces the single process, alone and with every other axis, and
moves the bytes docs/cp.md states."""

from __future__ import annotations

import pytest
import torch

from harness import Jobs, assert_close_run, one_step_comm, tiny_config
from memory_helpers import by_layout, check_bf16, predicted_activations, train_and_measure
from tetrad.layout import Layout
from tetrad.parallel.context import _block, chunk_positions, split_sequence

RING = {"cp_attention": "ring"}
# the fp64 layouts train 8 steps: a wrong shard, exchange or sum is off from the first
# step on, and 8 AdamW steps carry the optimizer state through its warm-up and after
STEPS = {"steps": 8}

# name -> (parallel, train overrides), grouped by world size (one spawn per group)
LAYOUTS = {
    2: {
        "cp2-ring-mb2-selective": (
            {"cp": 2, "microbatches": 2, **RING},
            {"recompute": "selective"},
        ),
        "cp2-full": ({"cp": 2}, {"recompute": "full"}),
    },
    4: {
        "cp4": ({"cp": 4}, {}),
        "cp4-ring": ({"cp": 4, **RING}, {}),
        "cp2xtp2-sp-ring": ({"cp": 2, "tp": 2, "sp": True, **RING}, {}),
        "cp2xdp2": ({"cp": 2, "dp": 2}, {}),
        "cp2xfsdp2-zero3": ({"cp": 2, "fsdp": 2, "zero_stage": 3}, {}),
        "cp2xpp2-1f1b-mb2-ring": ({"cp": 2, "pp": 2, "microbatches": 2, **RING}, {}),
    },
}


def _check_all(cases: dict, runs: list[dict], reference) -> None:
    failed = []
    for (name, (par, train)), got in zip(cases.items(), runs):
        ref = reference(parallel={"microbatches": par.get("microbatches", 1)}, train=STEPS | train)
        try:
            assert_close_run(got, ref)
        except AssertionError as e:
            failed.append(f"{name}: {e}")
    assert not failed, "\n".join(failed)


FOUR_AXES = {"pp2xfsdp2xcp2xtp2": ({"pp": 2, "fsdp": 2, "cp": 2, "tp": 2}, {})}


def declare_jobs(jobs: Jobs) -> None:
    """The layouts (2, 4 and 16 ranks), the volume steps, the bf16 and the activation runs."""
    for world, cases in LAYOUTS.items():
        cfgs = [tiny_config(parallel=par, train=STEPS | train) for par, train in cases.values()]
        jobs.add_training(f"layouts{world}", cfgs)
    for world in VOLUME:
        jobs.add(f"volume{world}", world, one_step_comm, [c.to_dict() for c in _volume(world)])
    jobs.add("bf16", 2, train_and_measure, [c.to_dict() for c in BF16])
    jobs.add("activations", 2, train_and_measure, [c.to_dict() for c in ACTIVATIONS])
    four = [tiny_config(parallel=par, train=STEPS) for par, _ in FOUR_AXES.values()]
    jobs.add_training("four-axes", four)


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_cp_matches_single_process(reference, jobs, world):
    _check_all(LAYOUTS[world], jobs[f"layouts{world}"][0], reference)


@pytest.mark.distributed
def test_cp_with_four_other_axes_on_16_ranks(reference, jobs):
    """pp 2 x fsdp 2 (ZeRO-3) x cp 2 x tp 2: four axes at once (16 processes on a small
    machine: one microbatch, the all-gather core; the ring meets pp, tp and sp above)."""
    _check_all(FOUR_AXES, jobs["four-axes"][0], reference)


# --- the chunk layout (pure) -------------------------------------------------------------


def test_chunks_partition_the_sequence_and_balance_causal_work():
    for cp in (1, 2, 3, 4):
        seq = 8 * cp
        held = [chunk_positions(seq, cp, r) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(seq))
        # pairs (query, key) under the causal mask: the same number on every rank
        work = {int((p[:, None] >= torch.arange(seq)[None, :]).sum()) for p in held}
        assert len(work) == 1, work
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_split_sequence_takes_the_two_chunks():
    x = torch.arange(24).view(2, 12)
    assert split_sequence(x, 3, 1).tolist() == [[2, 3, 8, 9], [14, 15, 20, 21]]
    assert split_sequence(x, 1, 0) is x
    with pytest.raises(ValueError, match="seq_len=12 does not split into 2\\*cp=8 chunks"):
        split_sequence(x, 4, 0)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_blocks_cover_exactly_the_causal_pairs(cp):
    """What each ring step computes (rows x cols, masked on the diagonal) is exactly the
    set of causal (query, key) pairs between the two ranks' chunks: none skipped, none extra."""
    c, seq = 2, 4 * cp
    for r in range(cp):
        q = chunk_positions(seq, cp, r)
        for src in range(cp):
            k = chunk_positions(seq, cp, src)
            want = q[:, None] >= k[None, :]
            rows, cols, diagonal = _block(r, src, c)
            got = torch.zeros_like(want)
            inside = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.bool)
            got[rows, cols] = inside.tril() if diagonal else inside
            assert torch.equal(got, want), (r, src)


def test_seq_len_not_divisible_by_2cp_is_refused():
    cfg = tiny_config(parallel={"cp": 4}, train={"seq_len": 12})
    with pytest.raises(ValueError, match=r"cp=4 .*2\*cp=8 .*seq_len=12 is not divisible by 8"):
        Layout.build(cfg, 4)


# --- communication volume ----------------------------------------------------------------


def cp_bytes(kind: str, cp: int, layers: int, micro: int, b: int, seq: int, kv_dim: int, e: int):
    """docs/cp.md's volume of one step on one rank: {op: (buffer bytes, bus bytes)}.

    N = 2·b·(S/cp)·kv_dim: the elements of one rank's keys and values of one layer and
    microbatch (kv_dim: this rank's kv heads times head_dim)."""
    n = 2 * b * (seq // cp) * kv_dim
    per = layers * micro
    if kind == "allgather":  # forward all-gather of cp·N, backward reduce-scatter of cp·N
        full = per * cp * n * e
        bus = full * (cp - 1) / cp
        return {"all_gather": (full, bus), "reduce_scatter": (full, bus)}
    # ring: cp-1 kv blocks forward, cp-1 again backward, and the fp32 dk, dv: cp hops
    sent = per * (2 * (cp - 1) * n * e + cp * n * 4)
    return {"send": (sent, sent)}


VOLUME = {  # world -> [(parallel, kv heads per rank)]; tiny: 2 layers, kv 2 x head_dim 8
    2: [({"cp": 2}, 2), ({"cp": 2, "microbatches": 2, **RING}, 2)],
    4: [({"cp": 4, **RING}, 2), ({"cp": 2, "tp": 2}, 1), ({"cp": 4}, 2)],
}


def _volume(world: int) -> list:
    return [tiny_config(parallel=par, train={"dtype": "fp32"}) for par, _ in VOLUME[world]]


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(VOLUME))
def test_cp_bytes_per_layer_are_the_formula(jobs, world):
    cfgs, summaries = _volume(world), jobs[f"volume{world}"]
    for (cfg, (_, kv_heads)), rank_sums in zip(zip(cfgs, VOLUME[world]), zip(*summaries)):
        p, t, m = cfg.parallel, cfg.train, cfg.model
        b = t.global_batch // (p.data_ranks * p.microbatches)
        want = cp_bytes(
            p.cp_attention, p.cp, m.layers, p.microbatches, b, t.seq_len, kv_heads * m.head_dim, 4
        )
        for summary in rank_sums:  # every rank moves the same
            got = {k.split("/")[1]: v for k, v in summary.items() if k.startswith("cp/")}
            for op, (buf, bus) in want.items():
                assert got[op]["bytes"] == buf, (p, op, got[op])
                assert got[op]["bus_bytes"] == pytest.approx(bus, rel=1e-12), (p, op)
            moved = {op for op, s in got.items() if s["bytes"]}
            assert moved == set(want), (p, moved)


# --- bf16 --------------------------------------------------------------------------------


BF16 = [
    tiny_config(parallel={"cp": 2, "cp_attention": a}, train={"dtype": "bf16"})
    for a in ("allgather", "ring")
]


@pytest.mark.distributed
def test_cp_in_bf16_is_the_bf16_single_process(reference, jobs):
    """bf16 compute under cp (both cores), 20 steps, held to the bf16 single process as
    every other axis is (memory_helpers.check_bf16), and visibly not the fp64 one."""
    bf16, fp64 = reference(train={"dtype": "bf16"}), reference(parallel={"microbatches": 1})
    for cfg, ranks in zip(BF16, by_layout(jobs["bf16"]), strict=True):
        check_bf16(cfg.parallel.cp_attention, ranks, bf16, fp64)


ACTIVATIONS = [
    tiny_config(parallel={"cp": 2} | par, train={"steps": 2, "dtype": "fp32"})
    for par in ({}, RING, {"cp_attention": "allgather"})
] + [
    tiny_config(
        parallel={"cp": 2} | RING, train={"steps": 2, "recompute": "selective", "dtype": "fp32"}
    )
]


@pytest.mark.distributed
def test_cp_activations_are_what_the_planner_counts(jobs):
    """cp 2 with each core, and with recompute: every rank's measured peak of saved
    activations is the planner's within 10%. The all-gather core keeps the other shard's
    keys and values and the mask by global position per layer; the ring keeps only its
    own shard's (its backward recomputes each block)."""
    cfgs, results = ACTIVATIONS, by_layout(jobs["activations"])
    for cfg, ranks in zip(cfgs, results):
        got = [r["activations"] for r in ranks]
        want = [predicted_activations(cfg, rank) for rank in range(2)]
        name = (cfg.parallel.cp_attention, cfg.train.recompute)
        assert got == pytest.approx(want, rel=0.10), (name, got, want)
    allgather, ring = results[0][0]["activations"], results[1][0]["activations"]
    assert ring < allgather  # the ring keeps no gathered keys and values
