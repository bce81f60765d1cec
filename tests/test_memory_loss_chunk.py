"""The head and the loss fused in chunks of tokens: equal to the unfused loss and gradients
(1e-6), alone and with vocabulary-parallel tp, and never building full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from harness import Jobs, tiny_config
from memory_helpers import by_layout, max_rel, predicted_activations, train_and_measure
from tetrad.models.llama import cross_entropy_sum
from tetrad.models.loss import linear_cross_entropy

# activation bytes are measured and predicted as users run them: fp32
FP32 = {"dtype": "fp32"}


def _inputs(n_seq=3, seq=7, dim=16, vocab=50):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n_seq, seq, dim, generator=gen, requires_grad=True)
    w = (0.3 * torch.randn(vocab, dim, generator=gen)).requires_grad_()
    t = torch.randint(0, vocab, (n_seq, seq), generator=gen)
    t[0, :3] = -100  # padding is excluded
    return h, w, t


@pytest.mark.parametrize("chunk", [1, 5, 16, 21, 0])
def test_equal_to_the_unfused_loss_and_gradients(chunk):
    h, w, t = _inputs()
    want = cross_entropy_sum(F.linear(h, w), t) / 7
    want_h, want_w = torch.autograd.grad(want, (h, w))
    got = linear_cross_entropy(h, w, t, chunk) / 7
    got_h, got_w = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in ((got_h, want_h), (got_w, want_w)):
        assert float((a - b).norm() / b.norm()) < 1e-6


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an operation produced."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_never_builds_full_logits():
    """Forward and backward: no tensor larger than one chunk of logits or the weight
    (the unfused loss builds N x V)."""
    h, w, t = _inputs(n_seq=4, seq=64, dim=16, vocab=200)
    n, chunk = t.numel(), 32
    with _Largest() as unfused:
        cross_entropy_sum(F.linear(h, w), t).backward()
    with _Largest() as fused:
        linear_cross_entropy(h, w, t, chunk).backward()
    assert unfused.numel >= n * 200
    assert fused.numel <= max(chunk * 200, w.numel(), h.numel()) < n * 200


LAYOUTS = [  # (parallel, model), 2 ranks
    ({"tp": 2}, {}),
    ({"tp": 2, "sp": True}, {}),
    ({"tp": 2}, {"tie_embeddings": True}),
    ({"fsdp": 2, "zero_stage": 3}, {}),
    ({"pp": 2, "microbatches": 2, "pp_schedule": "zb-h1"}, {}),
]
EVERY = [
    tiny_config(parallel=par, model=model, train={"loss_chunk": chunk, **FP32})
    for par, model in LAYOUTS
    for chunk in (0, 24)  # 24 does not divide a microbatch's 128 or 64 tokens
]
ZB_TP = [  # pp 2 x tp 2 with zb-h1, with and without sp, full and chunked loss
    tiny_config(
        parallel={"pp": 2, "tp": 2, "microbatches": 2, "pp_schedule": "zb-h1", "sp": sp},
        train={"loss_chunk": chunk, "steps": 2, **FP32},
    )
    for sp in (False, True)
    for chunk in (0, 24)
]


def declare_jobs(jobs: Jobs) -> None:
    """Each layout with the full and the chunked loss (2 ranks); pp x tp's peaks (4)."""
    jobs.add("every-layout", 2, train_and_measure, [c.to_dict() for c in EVERY])
    jobs.add("zb-tp", 4, train_and_measure, [c.to_dict() for c in ZB_TP])


@pytest.mark.distributed
def test_chunked_equals_unchunked_in_every_layout(jobs):
    """tp (vocabulary-parallel: one chunk's logits per rank) with and without sp and with
    a tied head, ZeRO-3, and a zero-bubble pipeline (whose deferred W then skips the
    head): 20 steps, losses and gradient norms within 1e-6, weights within 1e-5 norm-wise
    (Adam turns round-off in the weight gradient's chunked sum into weight noise); the
    last stage saves less, as the planner predicts."""
    layouts, cfgs, results = LAYOUTS, EVERY, by_layout(jobs["every-layout"])
    for i, (par, model) in enumerate(layouts):
        full, chunked = results[2 * i], results[2 * i + 1]
        try:
            assert max_rel(chunked[0]["losses"], full[0]["losses"]) <= 1e-6
            assert max_rel(chunked[0]["grad_norms"], full[0]["grad_norms"]) <= 1e-6
            for name, want in full[0]["state"].items():
                err = float((chunked[0]["state"][name] - want).norm() / want.norm())
                assert err <= 1e-5, f"{name}: {err:.1e}"
            last = len(full) - 1  # holds the head in every layout here
            assert chunked[last]["activations"] < full[last]["activations"]
            for cfg, run in zip(cfgs[2 * i : 2 * i + 2], (full, chunked)):
                want = predicted_activations(cfg, last)
                assert run[last]["activations"] == pytest.approx(want, rel=0.10)
        except AssertionError as e:
            raise AssertionError(f"layout {par} {model}: {e}") from e


@pytest.mark.distributed
def test_zero_bubble_tp_holds_what_the_planner_counts(jobs):
    """pp 2 x tp 2 with zb-h1, with and without sp, full and chunked loss: each rank's
    measured peak of saved activations, deferred weight-gradient inputs included, is the
    planner's within 10% (the column- and row-parallel linears keep different halves of
    their inputs and output gradients for W, and the vocabulary-parallel head keeps its
    input and its logits' gradient unless the chunked loss does its W in B)."""
    cfgs, results = ZB_TP, by_layout(jobs["zb-tp"])
    for cfg, ranks in zip(cfgs, results):
        got = [r["activations"] for r in ranks]
        want = [predicted_activations(cfg, rank) for rank in range(4)]
        for rank, (g, w) in enumerate(zip(got, want)):
            assert g == pytest.approx(w, rel=0.10), (
                cfg.parallel.sp,
                cfg.train.loss_chunk,
                rank,
                got,
                want,
            )
