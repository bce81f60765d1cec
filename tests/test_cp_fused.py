"""Context parallelism's block kernels: the fused ones (torch's attention ops, which return
the log-sum-exp) are the unfused reference block by block, forward and backward; the cores
run them (and only them) when asked; cp through them reproduces the single process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from harness import EXACT, Jobs, assert_close_run, tiny_config, train_many
from tetrad.layout import Layout
from tetrad.parallel import context_kernels as ck
from tetrad.parallel.context_kernels import KERNELS, kernel_name, pick_kernel

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

# --- one block, and two merged (pure) --------------------------------------------------------


def _qkvd(n: int, m: int, hd: int = 8, dtype=torch.float32, device="cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((2, 4, n, hd), (2, 4, m, hd), (2, 4, m, hd), (2, 4, n, hd))
    return [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]


def _merge(parts):
    """Two blocks' (out, lse) merged by log-sum-exp, as the cores' online softmax does."""
    (o1, l1), (o2, l2) = parts
    lse = torch.logaddexp(l1, l2)
    out = o1.float() * torch.exp(l1 - lse)[..., None] + o2.float() * torch.exp(l2 - lse)[..., None]
    return out.to(o1.dtype), lse


def _two_blocks(kernel, q, k1, v1, k2, v2, d, scale):
    """Queries against an earlier block (full) and their own (causal diagonal), merged; then
    each block's gradients given the merged out and lse: (out, lse, dq, dk1, dv1, dk2, dv2)."""
    out, lse = _merge(
        [kernel.forward(q, k1, v1, False, scale), kernel.forward(q, k2, v2, True, scale)]
    )
    dq1, dk1, dv1 = kernel.backward(d, q, k1, v1, out, lse, False, scale)
    dq2, dk2, dv2 = kernel.backward(d, q, k2, v2, out, lse, True, scale)
    return out, lse, dq1 + dq2, dk1, dv1, dk2, dv2


def _autograd_reference(q, k1, v1, k2, v2, d, scale):
    """The same attention in one call to torch's SDPA (mask: all of block 1, causal on
    block 2) and autograd's gradients: what the merged blocks must equal."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k1, v1, k2, v2)]
    n, m1 = q.shape[2], k1.shape[2]
    mask = torch.cat((torch.ones(n, m1, dtype=torch.bool), torch.ones(n, n).tril().bool()), 1)
    k, v = torch.cat(leaves[1::2], 2), torch.cat(leaves[2::2], 2)
    out = F.scaled_dot_product_attention(leaves[0], k, v, attn_mask=mask, scale=scale)
    out.backward(d.double())
    lse = torch.logsumexp((leaves[0] @ k.transpose(-1, -2) * scale).masked_fill(~mask, -1e9), -1)
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("causal, n, m", [(True, 6, 6), (False, 6, 3), (False, 3, 6)])
def test_fused_block_is_the_unfused_block(causal, n, m):
    """One block, fp32: the CPU flash op's (out, lse) and its gradients given them are the
    unfused matmuls' (diagonal causal; full off-diagonal, both of the ring's shapes)."""
    q, k, v, d = _qkvd(n, m)
    fused, unfused = KERNELS["cpu-flash"], KERNELS["unfused"]
    out, lse = fused.forward(q, k, v, causal, 0.3)
    want_out, want_lse = unfused.forward(q, k, v, causal, 0.3)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
    got = fused.backward(d, q, k, v, out, lse, causal, 0.3)
    want = unfused.backward(d, q, k, v, want_out, want_lse, causal, 0.3)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", ["cpu-flash", "unfused"])
def test_merged_blocks_are_whole_attention(name):
    """Two blocks merged by log-sum-exp, and each block's backward given the merged out and
    lse, are attention over both blocks at once and autograd's gradients (float64 reference)."""
    q, k2, v2, d = _qkvd(6, 6)
    _, k1, v1, _ = _qkvd(6, 4, seed=1)
    got = _two_blocks(KERNELS[name], q, k1, v1, k2, v2, d, 0.3)
    want = _autograd_reference(q, k1, v1, k2, v2, d, 0.3)
    names = ("out", "lse", "dq", "dk1", "dv1", "dk2", "dv2")
    for what, a, b in zip(names, got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=f"{name} {what}")


# --- which kernel runs (pure) ----------------------------------------------------------------


def test_the_kernel_follows_device_dtype_and_flag():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert kernel_name("fused", "cpu", fp32, 8) == "cpu-flash"
    assert kernel_name("fused", "cpu", bf16, 6) == "cpu-flash"  # any head size on CPU
    assert kernel_name("fused", "cuda", bf16, 64, (9, 0)) == "cuda-flash"
    assert kernel_name("fused", "cuda", fp16, 128, (8, 0)) == "cuda-flash"
    assert kernel_name("fused", "cuda", fp32, 64, (9, 0)) == "cuda-efficient"
    assert kernel_name("fused", "cuda", fp16, 64, (7, 5)) == "cuda-efficient"  # no flash < sm80
    assert kernel_name("fused", "cuda", bf16, 12, (9, 0)) == "unfused"  # not a multiple of 8
    assert kernel_name("fused", "cuda", bf16, 512, (9, 0)) == "unfused"  # over the kernels' 256
    assert kernel_name("fused", "mps", fp32, 64) == "unfused"
    for device in ("cpu", "cuda"):
        assert kernel_name("unfused", device, bf16, 64, (9, 0)) == "unfused"
    with pytest.raises(ValueError, match="cp_kernel='flash' is not one of"):
        kernel_name("flash", "cpu", fp32, 8)


def test_a_torch_without_the_op_gets_the_unfused_kernel(monkeypatch):
    monkeypatch.setattr(ck, "has_op", lambda op: "cpu" not in op)
    assert kernel_name("fused", "cpu", torch.float32, 8) == "unfused"
    assert kernel_name("fused", "cuda", torch.float32, 64, (9, 0)) == "cuda-efficient"
    assert pick_kernel("fused", torch.zeros(1, 1, 2, 8)) is KERNELS["unfused"]


def test_every_fused_kernels_ops_are_in_this_torch():
    for kernel in KERNELS.values():
        assert all(ck.has_op(op) for op in kernel.ops), kernel.name


def test_a_bad_cp_kernel_is_refused_by_the_layout():
    cfg = tiny_config(parallel={"cp": 2, "cp_kernel": "flash"})
    with pytest.raises(ValueError, match=r"cp_kernel='flash' is not one of \('fused', 'unfused'\)"):
        Layout.build(cfg, 2)


@pytest.mark.parametrize("name", ["cuda-flash", "cuda-efficient"])
def test_the_cuda_kernels_calls_fit_torchs_schemas(name):
    """Without a GPU: the CUDA kernels' calls go through torch's meta kernels (argument
    types and shapes, as the CUDA op checks them) and return one lse row per query, fp32,
    even where the efficient kernel pads them (n = 40: 64 rows)."""
    kernel, n, m = KERNELS[name], 40, 24
    q, k, v, d = (torch.empty(s, device="meta", dtype=torch.bfloat16) for s in _shapes(n, m))
    out, lse = kernel.forward(q, k, v, False, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 4, n) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(d, q, k, v, out, lse, False, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def _shapes(n: int, m: int, hd: int = 64):
    return (2, 4, n, hd), (2, 4, m, hd), (2, 4, m, hd), (2, 4, n, hd)


# --- cp through the fused kernel (2 ranks) ---------------------------------------------------

RING = {"cp": 2, "cp_attention": "ring"}
KERNEL_RUNS = {  # name -> (parallel, steps): the flag's two values on the ring
    "fused": (RING, 20),
    "unfused": (RING | {"cp_kernel": "unfused"}, 2),
}


def _counted(fn, counts: Counter, key: str):
    def run(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)

    return run


def _train_counting_kernels(rank: int, world: int, cfg_dicts: list[dict]) -> list[dict]:
    """Train each config with every block kernel's calls counted (name/forward,
    name/backward); the kernels are put back after (the other jobs of this spawn)."""
    saved = dict(KERNELS)
    out = []
    try:
        for raw in cfg_dicts:
            counts: Counter = Counter()
            for name, k in saved.items():
                KERNELS[name] = replace(
                    k,
                    forward=_counted(k.forward, counts, f"{name}/forward"),
                    backward=_counted(k.backward, counts, f"{name}/backward"),
                )
            (run,) = train_many(rank, world, [raw])
            out.append(run | {"kernel_calls": dict(counts)})
    finally:
        KERNELS.update(saved)
    return out


def _kernel_configs():
    return [
        tiny_config(parallel=par, train={"steps": steps}) for par, steps in KERNEL_RUNS.values()
    ]


def declare_jobs(jobs: Jobs) -> None:
    jobs.add("kernels", 2, _train_counting_kernels, [c.to_dict() for c in _kernel_configs()])


@pytest.mark.distributed
def test_cp_ring_through_the_fused_kernel_matches_single_process(reference, jobs):
    """cp 2, ring, fp32, 20 steps: the single process's losses, norms and weights (1e-5),
    every block through the CPU flash op, forward and backward, none unfused."""
    assert_close_run(jobs["kernels"][0][0], reference(parallel={"microbatches": 1}))
    # per step and layer: 2 blocks forward (diagonal, one half off-diagonal), 2 backward
    layers, steps = 2, 20
    want = {"cpu-flash/forward": 2 * layers * steps, "cpu-flash/backward": 2 * layers * steps}
    for rank, (fused, _) in enumerate(jobs["kernels"]):
        assert fused["kernel_calls"] == want, rank


@pytest.mark.distributed
def test_the_unfused_flag_runs_the_unfused_kernel_to_the_same_losses(jobs):
    """parallel.cp_kernel = "unfused": every block through the plain matmuls instead, and
    the same losses as the fused run (fp64 round-off: harness.EXACT)."""
    for rank, (_, unfused) in enumerate(jobs["kernels"]):
        assert unfused["kernel_calls"] == {"unfused/forward": 8, "unfused/backward": 8}, rank
    fused, unfused = jobs["kernels"][0]
    torch.testing.assert_close(
        torch.tensor(unfused["losses"]), torch.tensor(fused["losses"][:2]), rtol=EXACT, atol=0
    )


# --- the CUDA ops (skipped without a GPU) ----------------------------------------------------


CUDA_CASES = [("cuda-efficient", torch.float32, 1e-4), ("cuda-flash", torch.bfloat16, 3e-2)]


@pytest.mark.cuda
@pytest.mark.parametrize("name, dtype, tol", CUDA_CASES)
def test_cuda_kernels_are_the_unfused_blocks(name, dtype, tol):
    """On a GPU: the flash (bf16) and memory-efficient (fp32) ops are the ones picked for
    their dtype, and two merged blocks through them (forward, and backward given the
    merged out and lse) are the unfused matmuls'."""
    if name == "cuda-flash" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash attention needs sm80 or newer")
    q, k2, v2, d = _qkvd(48, 48, hd=64, dtype=dtype, device="cuda")
    _, k1, v1, _ = _qkvd(48, 40, hd=64, dtype=dtype, device="cuda", seed=1)
    assert pick_kernel("fused", q) is KERNELS[name]
    got = _two_blocks(KERNELS[name], q, k1, v1, k2, v2, d, 0.125)
    want = _two_blocks(KERNELS["unfused"], q, k1, v1, k2, v2, d, 0.125)
    names = ("out", "lse", "dq", "dk1", "dv1", "dk2", "dv2")
    for what, a, b in zip(names, got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=what)


def _train_on_gpus(tmp_path, name: str, *flags: str) -> list[float]:
    out = tmp_path / name
    argv = [sys.executable, "-m", "tetrad.cli", "train", "--model", "tiny", "--device", "cuda",
            "--data", "synthetic", "--steps", "3", "--global-batch", "4", "--seq-len", "64",
            "--no-progress", "--out", str(out), *flags]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.cuda
@pytest.mark.distributed
@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cp_ring_over_nccl_through_the_cuda_kernels_matches_one_gpu(tmp_path, dtype):
    """cp 2 ring on two GPUs (the efficient kernel in fp32, flash in bf16) against one GPU."""
    one = _train_on_gpus(tmp_path, "one", "--nproc", "1", "--dtype", dtype)
    cp = _train_on_gpus(
        tmp_path, "cp", "--nproc", "2", "--cp", "2", "--cp-attention", "ring", "--dtype", dtype
    )
    tol = 1e-4 if dtype == "fp32" else 2e-2
    torch.testing.assert_close(torch.tensor(cp), torch.tensor(one), rtol=tol, atol=0)
