"""Expert parallelism's parts: the layout's checks, the expert groups (pure), and the
all-to-all dispatcher against a per-token loop (values, gradients and bytes), on stand-in
experts with the MoE layer's interface."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import Jobs
from tetrad.layout import check_ep
from tetrad.mesh import Mesh, expert_groups

N, DIM, FFN, K, TOKENS = 4, 8, 6, 2, 12  # experts, width, expert ffn, top-k, tokens per rank


def deg(**kw: int) -> dict[str, int]:
    return {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 1, **kw}


# --- the layout's checks and the groups, pure ------------------------------------------


@pytest.mark.parametrize(
    "ep,experts,degrees,words",
    [
        (2, 0, deg(dp=2), "mixture-of-experts"),
        (4, 6, deg(dp=4), "experts=6 is not divisible by parallel.ep=4"),
        (4, 8, deg(dp=2, tp=4), ""),  # ep = tp: valid, checked below
        (3, 6, deg(dp=2), "must divide the data ranks"),
        (0, 4, deg(), "parallel.ep must be >= 1"),
    ],
)
def test_ep_refused_with_the_values_named(ep, experts, degrees, words):
    if ep == 4 and degrees["tp"] == 4:  # ep=tp=4 borrows the tp ranks: valid
        check_ep(ep, experts, degrees)
        return
    with pytest.raises(ValueError, match=words):
        check_ep(ep, experts, degrees)


def test_expert_groups_borrow_data_ranks_first():
    # dp 2 x tp 2, ep 2: the ep group is the two data ranks of one tp rank; the tp ranks
    # split the tokens, so the ranks holding the same experts span tp
    assert expert_groups(deg(dp=2, tp=2), 2) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    # ep 4 on dp 2 x tp 2: the tp ranks too; every rank holds different experts
    assert expert_groups(deg(dp=2, tp=2), 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    # fsdp before cp: ranks 0 and 2 differ in fsdp, 0 and 1 in cp
    assert expert_groups(deg(fsdp=2, cp=2), 2)[0] == [[0, 2], [1, 3]]
    # pipeline stages never share experts
    ep, edp = expert_groups(deg(pp=2, dp=2), 2)
    assert ep == [[0, 1], [2, 3]] and edp == [[0], [1], [2], [3]]
    mesh = Mesh.plan(deg(dp=4), 3, ep=2)
    assert mesh["ep"].ranks == [2, 3] and mesh["ep_data"].ranks == [1, 3]
    assert mesh.place["ep"] == 1 and mesh.place["ep_data"] == 1


# --- the dispatcher, on stand-in experts ------------------------------------------------


class StandInExperts(nn.Module):
    """The MoE layer's `Experts` interface: stacked SwiGLU weights, groups in order."""

    def __init__(self, n: int):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.w1 = nn.Parameter(torch.randn(n, FFN, DIM, generator=g) / 3)
        self.w3 = nn.Parameter(torch.randn(n, FFN, DIM, generator=g) / 3)
        self.w2 = nn.Parameter(torch.randn(n, DIM, FFN, generator=g) / 3)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.w1[e].T) * (x @ self.w3[e].T)) @ self.w2[e].T

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        groups = x.split(counts.tolist())
        return torch.cat([self.expert(e, xs) for e, xs in enumerate(groups)])


class StandInLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = StandInExperts(N)
        self.dispatch = None

    def use_dispatch(self, d) -> None:
        self.dispatch = d


def tokens(batch_rank: int, routing: str = "skewed"):
    """This data rank's tokens, routes and routing weights, the same on every tp rank.
    Routing "skewed": toward expert 0; "uniform": every expert the same number of copies;
    "first": experts 0 and 1 only (at ep 2 the second rank's experts receive nothing)."""
    g = torch.Generator().manual_seed(100 + batch_rank)
    x = torch.randn(TOKENS, DIM, generator=g)
    ids = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(TOKENS)])
    ids[: batch_rank + 2, 0] = 0
    ids[: batch_rank + 2, 1] = 1 + batch_rank % (N - 1)
    if routing == "uniform":  # token t to experts t and t+1 (mod N): TOKENS*K/N copies each
        ids = (torch.arange(TOKENS)[:, None] + torch.arange(K)) % N
    if routing == "first":
        ids = torch.arange(K).repeat(TOKENS, 1)
    return x, ids, torch.rand(TOKENS, K, generator=g), torch.randn(TOKENS, DIM, generator=g)


def per_token(x, ids, weights, experts):
    """The definition: each token's weighted sum over its k experts, one at a time."""
    rows = []
    for t in range(x.shape[0]):
        rows.append(sum(weights[t, j] * experts.expert(int(ids[t, j]), x[t]) for j in range(K)))
    return torch.stack(rows)


def _dispatch_worker(
    rank: int, world: int, degrees: dict[str, int], ep: int, routing: str = "skewed"
) -> dict:
    from tetrad.comm import Comm
    from tetrad.layout import Layout
    from tetrad.parallel.expert import apply_ep

    layout = Layout.build(_config(degrees, ep), world)
    mesh = Mesh.build(layout, rank)
    comm = Comm("cpu")
    layer = StandInLayer()
    full = {n: p.detach().clone() for n, p in layer.experts.named_parameters()}
    ep_layout = apply_ep(layer, layout, mesh, comm)
    index = ep_layout.slicer(None)
    for name, p in layer.experts.named_parameters():
        p.data = full[name][index(f"experts.{name}")].clone()
    batch = mesh.coord["dp"]
    x, ids, weights, grad = tokens(batch, routing)
    x.requires_grad_()
    out = layer.dispatch(x, ids, weights, layer.experts)
    out.backward(grad)
    comm.all_reduce(x.grad, mesh["tp"])  # the MoE layer's tp region sums the shares' grads
    for _, p in layer.experts.named_parameters():
        if p.grad is None:  # no token reached these experts
            p.grad = torch.zeros_like(p)
        comm.all_reduce(p.grad, mesh["ep_data"])  # what the gradient sync does
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": {n: p.grad for n, p in layer.experts.named_parameters()},
        "slot": mesh["ep"].rank,
        "batch": batch,
        "comm": comm.summary(),
    }


def _config(degrees: dict[str, int], ep: int):
    from harness import tiny_config

    model = {"family": "moe", "experts": N, "top_k": K, "moe_ffn_dim": FFN}
    par = {**{a: d for a, d in degrees.items()}, "ep": ep}
    return tiny_config(model=model, parallel=par)


DISPATCH = {"ep2": (deg(dp=2), 2), "ep4": (deg(dp=4), 4), "ep2-tp2": (deg(dp=2, tp=2), 2)}
DISPATCH["ep4-tp2"] = (deg(dp=2, tp=2), 4)
DISPATCH["ep2-idle"] = (deg(dp=2), 2, "first")  # rank 1's experts receive no token


def declare_jobs(jobs: Jobs) -> None:
    for name, (degrees, ep, *routing) in DISPATCH.items():
        world = degrees["dp"] * degrees["tp"]
        jobs.add(f"dispatch-{name}", world, _dispatch_worker, degrees, ep, *routing)
    jobs.add("uniform", 4, _dispatch_worker, deg(dp=4), 4, "uniform")


def _expected(degrees: dict[str, int], routing: str = "skewed"):
    """Per data rank: the per-token outputs and input gradients; and the expert weights'
    gradients summed over every data rank (each token once)."""
    ref = StandInExperts(N)
    outs, x_grads = [], []
    for b in range(degrees["dp"]):
        x, ids, weights, grad = tokens(b, routing)
        x.requires_grad_()
        out = per_token(x, ids, weights, ref)
        out.backward(grad)
        outs.append(out.detach())
        x_grads.append(x.grad)
    return outs, x_grads, {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(DISPATCH))
def test_all_to_all_dispatch_equals_per_token_loop(jobs, name):
    degrees, ep, *routing = DISPATCH[name]
    outs, x_grads, grads = _expected(degrees, *routing)
    local = N // ep
    for got in jobs[f"dispatch-{name}"]:
        b, slot = got["batch"], got["slot"]
        torch.testing.assert_close(got["out"], outs[b], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["x_grad"], x_grads[b], rtol=1e-5, atol=1e-6)
        for n, g in got["grads"].items():
            want = grads[n][slot * local : (slot + 1) * local]
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_all_to_all_bytes_are_the_copies_that_leave_the_rank(jobs):
    """Forward sends each copy routed to another rank's experts there and its output back
    (the same rows, received), backward the same again: 4 x dim floats per such copy,
    plus the counts (one int64 per expert sent to each other rank, forward only)."""
    degrees, ep = DISPATCH["ep4"]
    routes = [tokens(b)[1] for b in range(4)]
    owner = torch.arange(N) // (N // ep)  # the rank holding each expert
    for rank, got in enumerate(jobs["dispatch-ep4"]):
        leaving = int((owner[routes[rank]] != rank).sum())
        arriving = sum(int((owner[routes[r]] == rank).sum()) for r in range(4) if r != rank)
        tokens_stat = got["comm"]["ep/all_to_all"]
        assert tokens_stat["calls"] == 4
        assert tokens_stat["bus_bytes"] == 2 * (leaving + arriving) * DIM * 4
        counts = got["comm"]["ep/all_to_all_counts"]
        assert counts["bus_bytes"] == (ep - 1) * (N // ep) * 8


@pytest.mark.distributed
def test_bytes_per_token_per_layer_formula(jobs):
    """docs/moe.md: under uniform routing each rank sends, per MoE layer and step, 4 x T x
    k x dim x bytes x (ep-1)/ep (dispatch and combine, forward and backward) for its T
    tokens; the measured count equals it."""
    ep, c = 4, 4  # fp32
    for got in jobs["uniform"]:
        formula = 4 * TOKENS * K * DIM * c * (ep - 1) / ep
        assert got["comm"]["ep/all_to_all"]["bus_bytes"] == formula
