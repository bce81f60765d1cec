"""The simulator against the closed forms of the literature, exactly.

Notation: p pipeline ranks, m microbatches, v chunks per rank; f, b, w the forward,
input-gradient and weight-gradient times of one stage; BW costs b + w. Unit costs are
f = b = w = 1, so one microbatch's work on a stage is 3.
"""

from __future__ import annotations

import itertools

import pytest

from tetrad.parallel.pipeline.schedules import Action, build_schedule
from tetrad.parallel.pipeline.simulate import Costs, Dag, simulate, simulate_schedule

UNIT = Costs(f=1, b=1, w=1, comm=0)
PS, MS = range(1, 9), range(1, 17)


def _run(name, p, m, costs=UNIT, v=1):
    return simulate_schedule(name, p, m, costs, virtual_stages=v)


def test_costs():
    c = Costs(f=[1, 2], b=3, w=[4, 5], comm=0.5)
    assert (c.of("F", 1), c.of("B", 0), c.of("W", 1), c.of("BW", 0)) == (2, 3, 5, 7)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_1f1b_textbook_bubble(name):
    """Bubble time (p-1)(f+b+w); fraction of the step (p-1)/(m+p-1), every p and m."""
    for p, m in itertools.product(PS, MS):
        t = _run(name, p, m)
        assert t.makespan == 3 * (m + p - 1)
        assert t.bubble_time == 3 * (p - 1)
        assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("f, b, w", [(1, 2, 1), (2, 1, 1), (1, 1, 2), (1.5, 2.5, 0.5)])
def test_1f1b_any_uniform_costs(f, b, w):
    for p, m in itertools.product(range(1, 7), range(1, 13)):
        t = _run("1f1b", p, m, Costs(f, b, w))
        assert t.makespan == pytest.approx((m + p - 1) * (f + b + w))


def test_gpipe_with_communication():
    """Each of the 2(p-1) hops of the first forward and last backward adds comm."""
    for p, m, c in itertools.product(range(1, 6), (1, 4, 7), (0.25, 1.0)):
        t = _run("gpipe", p, m, Costs(1, 2, 1, comm=c))
        assert t.makespan == pytest.approx((m + p - 1) * 4 + 2 * (p - 1) * c)


@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_one_vth(v):
    """Per chunk costs f = b = w = 1: bubble time (p-1)(f+b+w), fraction
    (p-1)/(v*m + p-1); 1F1B on the same model (stages v times as costly) has v times the
    bubble time."""
    for p in PS:
        for m in range(p, 17, p):
            t = _run("interleaved-1f1b", p, m, v=v)
            assert t.makespan == 3 * (v * m + p - 1)
            assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
            same_model = _run("1f1b", p, m, Costs(v, v, v))
            assert t.bubble_time * v == same_model.bubble_time


def test_interleaved_any_uniform_costs():
    for (f, b, w), p, v in itertools.product([(1, 2, 1), (2, 1, 0.5)], (2, 3, 4), (2, 3)):
        for m in (p, 2 * p, 3 * p):
            t = _run("interleaved-1f1b", p, m, Costs(f, b, w), v)
            assert t.makespan == pytest.approx((v * m + p - 1) * (f + b + w))


def test_zb_h1_bubble_is_a_third_of_1f1b():
    """Qi et al. (2023), Table 2: ZB-H1's bubble is (p-1)(T_F + T_B - T_W) against
    1F1B's (p-1)(T_F + T_B + T_W): with equal times, exactly a third (m >= p)."""
    for p in PS:
        for m in range(p, 17):
            t = _run("zb-h1", p, m)
            assert t.makespan == 3 * m + (p - 1)
            assert t.bubble_time * 3 == _run("1f1b", p, m).bubble_time
            assert t.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("f, b, w", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 3, 1), (1, 1, 0.5)])
def test_zb_h1_closed_form(f, b, w):
    """Whenever w <= min(f, b) (W fits the gaps it fills), for every m >= p:
    makespan = m(f+b+w) + (p-1)(f+b-w)."""
    for p in range(1, 8):
        for m in range(p, 15):
            t = _run("zb-h1", p, m, Costs(f, b, w))
            assert t.makespan == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))


def test_zb_h1_few_microbatches():
    """m < p: rank 0 waits p*f + (p-1)*b for its first gradient, then runs its m B's and
    m W's back to back, which is the least possible."""
    for p in PS:
        for m in range(1, p):
            assert _run("zb-h1", p, m).makespan == p + (p - 1) + 2 * m


def test_zb_v_bubble():
    """ZB-V with per-chunk f = b = w: the only idle time is the (p-1) chunk forwards before
    the bottom of the V gets its first input: a sixth of 1F1B's bubble on the same model,
    once m >= 3p/2."""
    for p in PS:
        for m in range(3 * p // 2, 17):
            for unit in (1, 2.5):
                t = _run("zb-v", p, m, Costs(unit, unit, unit), v=2)
                assert t.makespan == pytest.approx(6 * m * unit + (p - 1) * unit)
            same_model = _run("1f1b", p, m, Costs(2, 2, 2))
            assert _run("zb-v", p, m, v=2).bubble_time * 6 == same_model.bubble_time


def test_peak_activations():
    """1F1B holds min(p - r, m) microbatches on rank r, GPipe all m; ZB-H1 holds 1F1B's
    plus up to r+1 weight gradients pending; interleaved rank 0 holds v*p + p - 1 chunks
    (Korthikanti et al.: L*(1 + (p-1)/(p*v)) layers); ZB-V 2p chunks, 1F1B's memory."""
    for p, m in itertools.product(range(1, 7), (1, 3, 6, 12)):
        assert _run("1f1b", p, m).peak_activations() == [min(p - r, m) for r in range(p)]
        assert _run("gpipe", p, m).peak_activations() == [m] * p
        if m >= p:
            zb = _run("zb-h1", p, m)
            assert zb.peak_activations() == [p - r for r in range(p)]
            assert zb.peak_pending_w() == [r + 1 for r in range(p)]
        if m >= 2 * p - 1:
            assert _run("zb-v", p, m, v=2).peak_activations() == [2 * p] * p
    for p, v in itertools.product((2, 4), (2, 3)):
        t = _run("interleaved-1f1b", p, 2 * p, v=v)
        assert t.peak_activations()[0] == v * p + p - 1


def test_heterogeneous_stages_by_hand():
    """GPipe, p=2, m=2, stage 1's forward twice as slow: worked out on paper."""
    t = simulate(build_schedule("gpipe", 2, 2), Costs(f=[1, 2], b=1, w=1))
    assert [(e.kind, e.start, e.end) for e in t.ranks[1]] == [
        ("F", 1, 3), ("F", 3, 5), ("BW", 5, 7), ("BW", 7, 9)
    ]  # fmt: skip
    assert [(e.kind, e.start, e.end) for e in t.ranks[0]][2:] == [("BW", 7, 9), ("BW", 9, 11)]
    assert t.makespan == 11


def test_costs_must_cover_every_stage():
    with pytest.raises(ValueError, match="Costs.f has 2 entries for 4 stages"):
        simulate_schedule("1f1b", 4, 4, Costs(f=[1, 1]))


def test_one_dag_times_any_costs():
    """A schedule's Dag (what a planner keeps per schedule) holds no costs: timed on one
    set of costs and then another, it gives what a fresh simulation of each gives, event
    by event; and the waits it records are real (comm moves the step)."""
    acts = build_schedule("zb-v", 3, 6, 2)
    dag = Dag.of(acts)
    for costs in (Costs([1, 2, 1, 3, 1, 2], 0.5, 0.25, comm=0.1, p2p=0.01), UNIT):
        start, end = dag.times(costs)
        got = [[(dag.computes[i].kind, dag.computes[i].stage, start[i], end[i]) for i in rank]
               for rank in dag.ranks]  # fmt: skip
        want = simulate(acts, costs).ranks
        assert got == [[(e.kind, e.stage, e.start, e.end) for e in rank] for rank in want]
    assert max(dag.times(Costs(comm=1.0))[1]) > max(dag.times(UNIT)[1])


def test_simulator_reports_deadlock():
    bad = [
        [Action("RECV_B", 0, 0, 1), Action("F", 0, 0), Action("SEND_F", 1, 0, 1)],
        [Action("RECV_F", 1, 0, 0), Action("F", 1, 0), Action("SEND_B", 0, 0, 0)],
    ]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad, UNIT)


def test_overhead_per_compute_on_one_rank():
    """pp=1: every compute but the first waits `overhead` after the one before."""
    for m, o in itertools.product((1, 3, 8), (0.0, 0.25)):
        t = _run("1f1b", 1, m, Costs(1, 2, 1, overhead=o))
        assert t.makespan == pytest.approx(4 * m + (2 * m - 1) * o)


def test_overhead_hides_behind_a_wait():
    """A rank that waits for a transfer does its bookkeeping meanwhile: with overhead and
    p2p below comm, one microbatch's 2(p-1) hops cost comm each, not more; only the last
    rank's F -> B, back to back without a transfer, pays the overhead."""
    for p in (2, 3, 4):
        bare = _run("gpipe", p, 1, Costs(1, 1, 1, comm=0.5))
        busy = _run("gpipe", p, 1, Costs(1, 1, 1, comm=0.5, overhead=0.1, p2p=0.1))
        assert busy.makespan == pytest.approx(bare.makespan + 0.1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_learned_overhead_is_consistent(name):
    """The estimator reads the overhead back off a timeline the simulator made with it,
    exactly, and the simulator given the estimate predicts the same bubble; the same
    schedule without the overhead term predicts less (so the term is not a no-op)."""
    from tetrad.parallel.pipeline.measure import estimate_costs

    for p in (2, 4):
        v = 2 if name in ("interleaved-1f1b", "zb-v") else 1
        stages = p * v
        true = Costs(
            f=[1.0 + 0.1 * s for s in range(stages)],
            b=[1.5 + 0.05 * s for s in range(stages)],
            w=[0.8] * stages,
            comm=0.3,
            overhead=0.05,
            p2p=0.02,
        )
        tl = _run(name, p, 2 * p, true, v)
        actions = build_schedule(name, p, 2 * p, v)
        got = estimate_costs(tl, stages, actions)
        assert (got.comm, got.overhead, got.p2p) == pytest.approx((0.3, 0.05, 0.02), abs=1e-9)
        again = _run(name, p, 2 * p, got, v)
        assert again.bubble_fraction == pytest.approx(tl.bubble_fraction, abs=1e-9)
        bare = _run(name, p, 2 * p, Costs(got.f, got.b, got.w, got.comm), v)
        assert bare.bubble_fraction < tl.bubble_fraction - 0.005


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_replay_reproduces_a_jittery_step(name):
    """A step whose computes each took their own time (jitter: every fourth one 60%
    slower) is reproduced exactly when replayed action by action (`replay_costs`), where
    the per-stage medians (one figure per stage and kind) do not reproduce it."""
    from tetrad.parallel.pipeline.measure import estimate_costs, replay_costs

    for p in (2, 4):
        v = 2 if name in ("interleaved-1f1b", "zb-v") else 1
        actions = build_schedule(name, p, 2 * p, v)
        computes = [a for acts in actions for a in acts if a.is_compute]
        slow = {(a.kind, a.stage, a.microbatch): 1.6 * (1.5 if a.kind == "BW" else 1.0)
                for k, a in enumerate(computes) if k % 4 == 0}  # fmt: skip
        true = Costs(1.0, 0.8, 0.7, comm=0.1, overhead=0.02, each=slow)
        tl = _run(name, p, 2 * p, true, v)
        medians = estimate_costs(tl, p * v, actions)
        replayed = _run(name, p, 2 * p, replay_costs(tl, medians), v)
        assert replayed.makespan == pytest.approx(tl.makespan, rel=1e-9)
        assert replayed.bubble_fraction == pytest.approx(tl.bubble_fraction, abs=1e-9)
        assert abs(_run(name, p, 2 * p, medians, v).makespan / tl.makespan - 1) > 0.01


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_transfer_programs_cost_what_the_schedule_does(name):
    """The runtime's transfer programs, timed with rendezvous sends, lose nothing to the
    action-level simulation: gloo's (receives posted one compute early) at uniform and
    skewed stage costs (a heavy first and last stage), NCCL's (in order) at uniform costs
    and never beat it; a program that posts its receives late loses (so the comparison
    can fail)."""
    from tetrad.parallel.pipeline.p2p import program
    from tetrad.parallel.pipeline.program_sim import simulate_program

    for p in (2, 4):
        v = 2 if name in ("interleaved-1f1b", "zb-v") else 1
        n, acts = p * v, build_schedule(name, p, 2 * p, v)
        skew = Costs([3] + [2] * (n - 2) + [4], [4] + [3] * (n - 2) + [5], 1.5, comm=0.3)
        for costs in (UNIT, skew):
            want = simulate(acts, costs).makespan
            gloo = simulate_program(program(acts, early=1), costs).makespan
            nccl = simulate_program(program(acts, early=0), costs).makespan
            assert gloo == pytest.approx(want)
            assert nccl >= want - 1e-9
            if costs is UNIT:
                assert nccl == pytest.approx(want)
        late = [_late_receives(items) for items in program(acts, early=1)]
        try:  # late receives stall the senders' waits, or even deadlock them
            assert simulate_program(late, skew).makespan > simulate(acts, skew).makespan + 0.1
        except ValueError as e:
            assert "deadlock" in str(e)


def _late_receives(items):
    """A program whose receives are posted only right before the wait that needs them."""
    from tetrad.parallel.pipeline.p2p import Post, Wait

    recvs = {a for i in items if isinstance(i, Post) for a in i.ops if a.kind.startswith("RECV")}
    out = []
    for item in items:
        if isinstance(item, Post):
            sends = tuple(a for a in item.ops if a not in recvs)
            out += [Post(sends)] if sends else []
        elif isinstance(item, Wait):
            mine = tuple(a for a in item.ops if a in recvs)
            out += [Post(mine)] if mine else []
            out.append(item)
        else:
            out.append(item)
    return out
