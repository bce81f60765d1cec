"""An MoE step costs no host sync and no collective of its own: the routing statistics
(the loss-free bias's loads, the metrics' expert load, aux loss and entropy) ride on the
step's one all-reduce over the world and are read by its one host sync."""

from __future__ import annotations

from functools import partial

import pytest

from harness import Jobs, tiny_config

pytestmark = pytest.mark.distributed

# Python-visible ways a tensor's value reaches the host (each one a device sync on a GPU)
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
MOE = {"family": "moe", "experts": 4, "top_k": 2, "moe_ffn_dim": 32, "shared_experts": 1}
CONFIGS = {
    "dense": {},
    "moe-aux": {**MOE, "dense_layers": 1},
    "moe-bias": {**MOE, "dense_layers": 1, "balance": "bias", "bias_rate": 0.01},
}


def _with_syncs_counted(fn):
    """fn()'s result, and the host syncs (tensor methods, in order) it made."""
    import torch

    syncs: list[str] = []
    originals = {n: getattr(torch.Tensor, n) for n in SYNCS}

    def counting(n):
        def call(self, *args, **kwargs):
            syncs.append(n)
            return originals[n](self, *args, **kwargs)

        return call

    for n in SYNCS:
        setattr(torch.Tensor, n, counting(n))
    try:
        return fn(), syncs
    finally:
        for n, method in originals.items():
            setattr(torch.Tensor, n, method)


def _step_and_row(trainer):
    """One training step and its metrics row (what `Trainer.fit` does per step)."""
    return trainer.metrics(trainer.train_step(), 0.1, 0.0)


def _counted_step(rank: int, world: int, configs: dict[str, dict]) -> dict[str, dict]:
    """Per config: the host syncs and the collectives (calls per axis/op) of one step and
    its metrics row, after two steps of warm-up; and whether the bias moved."""
    import torch

    from harness import trainer_for
    from tetrad.config import from_dict
    from tetrad.models.moe import moe_layers

    out = {}
    for name, raw in configs.items():
        trainer = trainer_for(from_dict(raw), rank)
        for _ in range(2):
            _step_and_row(trainer)
        layers = moe_layers(trainer.engine.model)
        before = [f.router.expert_bias.clone() for f in layers.values()]
        trainer.comm.reset()
        row, syncs = _with_syncs_counted(partial(_step_and_row, trainer))
        after = [f.router.expert_bias for f in layers.values()]
        out[name] = {
            "syncs": syncs,
            "calls": {k: v["calls"] for k, v in trainer.comm.summary().items()},
            "moe_layers": row.get("moe_layers"),
            "bias_moved": any(not torch.equal(a, b) for a, b in zip(after, before)),
        }
    return out


def declare_jobs(jobs: Jobs) -> None:
    """One 2-rank job (dp 2): the dense model and two MoE models, one after the other."""
    raw = {
        # fp32, as users run it: fp64 takes the grouped matmul's loop (a read per group)
        name: tiny_config(model=model, parallel={"dp": 2}, train={"dtype": "fp32"}).to_dict()
        for name, model in CONFIGS.items()
    }
    jobs.add("counted", 2, _counted_step, raw)


def test_moe_step_adds_no_host_sync_and_no_collective(jobs):
    for rank, out in enumerate(jobs["counted"]):
        dense, aux, bias = out["dense"], out["moe-aux"], out["moe-bias"]
        # the MoE models did record, report and (bias) update from the step's statistics
        assert aux["moe_layers"] and bias["moe_layers"], out
        assert bias["bias_moved"] and not aux["bias_moved"], out
        for moe in (aux, bias):
            assert moe["syncs"] == dense["syncs"], f"rank {rank}: {moe['syncs']} vs dense"
            # gradient buckets differ with the parameter count: every other collective
            # (the step's all-reduce over the world, the metrics' two) is the dense one's
            others = {k: v for k, v in moe["calls"].items() if k != "data/all_reduce"}
            assert others == {k: v for k, v in dense["calls"].items() if k != "data/all_reduce"}
        # ...and the bias update's loads add no all-reduce over the data ranks either
        assert bias["calls"] == aux["calls"], f"rank {rank}: {bias['calls']} vs {aux['calls']}"
