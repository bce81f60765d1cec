"""Shared by the memory tests: a worker that trains configs in one set of ranks and reports,
per rank, the losses, norms, final weights (rank 0), model state measured and predicted,
and the measured peak of saved activations; and the bf16 layout check.

bf16 rounds differently when a layout splits a matmul (tp's partial sums) or a batch (each
data rank's gradient is rounded before the fp32 reduction), by amounts that depend on the
CPU's kernels, so a bf16 layout is held to a multiple of the bf16 single process's own
distance from the fp64 single process (harness.check_rounded, whose docstring states the
bound and its reason). That bf16 is really on is checked too: the bf16 single process's
losses differ from the fp64 ones by more than 2e-5 (an fp32 run's differ by about 1e-6),
and the model state measured on every rank is the bf16 prediction (2-byte compute
parameters), to the byte.
"""

from __future__ import annotations

from typing import Any

from harness import check_rounded, trainer_for
from plan_helpers import planned
from tetrad.config import from_dict
from tetrad.layout import Layout
from tetrad.mesh import Mesh
from tetrad.parallel.model_state import model_state_bytes


def train_and_measure(rank: int, world: int, raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for raw in raws:
        cfg = from_dict(raw)
        trainer = trainer_for(cfg, rank)
        rows = trainer.fit()
        state = trainer.engine.full_state_dict()
        out.append(
            {
                "losses": [r["loss"] for r in rows],
                "grad_norms": [r["grad_norm"] for r in rows],
                "state": state if rank == 0 else None,
                "memory": (
                    trainer.measured_state[-1],
                    model_state_bytes(Layout.build(cfg), cfg.model, rank),
                ),
                "activations": trainer.engine.last_run.peak_activation_bytes,
                "row": rows[-1],
            }
        )
    return out


def by_layout(per_rank: list[list[dict]]) -> list[list[dict]]:
    """[rank][layout] -> [layout][rank]."""
    return [list(r) for r in zip(*per_rank)]


BF16_VISIBLE = 2e-5  # a bf16 run differs from the fp64 one by more than this somewhere


def max_rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def check_bf16(layout: Any, ranks: list[dict], bf16: dict, fp64: dict) -> None:
    """A bf16 layout's run (per rank) against the bf16 and fp64 single-process runs."""
    got = ranks[0]
    try:
        check_rounded(got, bf16, fp64)
        assert max_rel(bf16["losses"], fp64["losses"]) > BF16_VISIBLE, "bf16 is not on"
        for rank, r in enumerate(ranks):
            measured, predicted = r["memory"]
            assert measured == predicted, f"rank {rank}: measured {measured} != {predicted}"
    except AssertionError as e:
        raise AssertionError(f"layout {layout}: {e}") from e


def predicted_activations(cfg, rank: int) -> float:
    """The planner's peak activation bytes for global `rank` of `cfg` (tetrad's engine,
    cfg's recompute mode)."""
    from tetrad.plan.cost import Planner
    from tetrad.plan.engines import TETRAD
    from tetrad.plan.hardware import cluster_preset

    planner = Planner(cluster_preset("cpu"), TETRAD, cfg.train.recompute)
    return planner.rank_activations(
        *planned(cfg), Mesh.plan(cfg.parallel.degrees, rank).coord["pp"]
    )
