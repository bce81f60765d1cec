"""FP8 linears split over ranks (models/fp8.py `Float8Linear.split_over`): two ranks each
holding half of a linear's tokens (cp, "M"), output features (column tp, "N") or input
features (row tp, "K") take every scale as the max over both, and so compute the single
process's FP8 matmuls: what a rank computes whole is the single process's slice, what it
computes in part sums to it within fp32 rounding. Without the shared max, the halves'
own scales move the results by FP8 steps."""

from __future__ import annotations

import pytest
import torch

from harness import Jobs
from tetrad.models.fp8 import RECIPES, Float8Linear

pytestmark = pytest.mark.distributed

M, K, N = 32, 64, 48


def _operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K], weight [N, K], output gradient [M, N]; every second half (of every
    dimension) 4 times the first, so that no half holds the whole tensor's largest value."""
    torch.manual_seed(0)
    x, w, g = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)
    for t in (x, w, g):
        t[t.shape[0] // 2 :] *= 4
        t[:, t.shape[1] // 2 :] *= 4
    return x, w, g


def _run(x, w, g, recipe: str, split=None) -> tuple[torch.Tensor, ...]:
    """(output, input gradient, weight gradient) of an FP8 linear of weight `w`."""
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(w.clone())
    fp8 = Float8Linear(linear, recipe)
    if split is not None:
        fp8.split_over(*split)
    x = x.clone().requires_grad_()
    out = fp8(x)
    out.backward(g)
    return out.detach(), x.grad, fp8.weight.grad


def _worker(rank: int, world: int) -> dict:
    from tetrad.comm import Comm
    from tetrad.config import ParallelConfig
    from tetrad.mesh import Mesh
    from tetrad.parallel.compress import max_over

    group, comm = Mesh.build(ParallelConfig(dp=world), rank)["dp"], Comm("cpu")
    shared_max = max_over(comm, group)

    def summed(t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, group)
        return t

    x, w, g = _operands()
    m, n, k = (slice(rank * d // 2, (rank + 1) * d // 2) for d in (M, N, K))
    # per split: this rank's (x, w, g), and for (out, grad_x, grad_w) the slice of the
    # single process's it computes whole, or None where its part is summed over the ranks
    parts = {
        "M": ((x[m], w, g[m]), (m, m, None)),
        "N": ((x, w[n], g[:, n]), ((slice(None), n), None, n)),
        "K": ((x[:, k], w[:, k], g), (None, (slice(None), k), (slice(None), k))),
    }
    out = {}
    for recipe in RECIPES:
        single = _run(x, w, g, recipe)
        for dim, (mine, whole) in parts.items():
            for shared in (True, False):
                got = _run(*mine, recipe, (dim, shared_max) if shared else None)
                pairs = [(t, ref[at]) if at is not None else (summed(t), ref)
                         for t, ref, at in zip(got, single, whole)]  # fmt: skip
                out[recipe, dim, shared] = [float((a - b).norm() / b.norm()) for a, b in pairs]
    return out


def declare_jobs(jobs: Jobs) -> None:
    jobs.add("fp8-split", 2, _worker)


@pytest.mark.rounding
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dim", ["M", "N", "K"])
def test_a_split_linear_computes_the_single_process_fp8_matmuls(jobs, recipe, dim):
    """Shared scales: every result within 1e-6 of the single process's (the same FP8
    operands: a slice computed whole differs only if a kernel sums another way, 0 here; a
    part summed over ranks by two fp32 partial sums against one, 6e-8 to 7e-8 here); the
    halves' own scales: some result off by more than 1e-3 (measured 3e-3 to 8e-2: an FP8
    step is 2^-4 to 2^-3 of a value)."""
    for rank in jobs["fp8-split"]:
        assert max(rank[recipe, dim, True]) < 1e-6
        assert max(rank[recipe, dim, False]) > 1e-3


def test_a_split_dimension_is_one_of_the_matmuls():
    linear = Float8Linear(torch.nn.Linear(4, 4), "tensorwise")
    with pytest.raises(ValueError, match="'B'"):
        linear.split_over("B", lambda a: a)


def test_a_dimension_split_twice_takes_both_maxima():
    """Tokens split over cp and, before an SP region, over tp: the max over both groups."""
    linear = Float8Linear(torch.nn.Linear(4, 4), "tensorwise")
    linear.split_over("M", lambda amax: amax * 2)
    linear.split_over("M", lambda amax: amax + 1)
    assert float(linear.splits["M"](torch.tensor(1.0))) == 3
