"""bf16 mixed precision in every layout: bf16 compute parameters, fp32 masters and AdamW,
gradients reduced in `reduce_dtype`, the loss in fp32. The tolerances, and how a test
knows bf16 is really on, are stated in memory_helpers.py; fsdp × tp × pp in bf16 is in
test_fsdp.py (8 ranks).
"""

from __future__ import annotations

import pytest
import torch

from harness import Jobs, tiny_config
from memory_helpers import BF16_VISIBLE, by_layout, check_bf16, max_rel, train_and_measure
from tetrad.models.flops import param_count
from tetrad.parallel.model_state import ModelState

BF16 = {"dtype": "bf16"}


def test_bf16_single_process_keeps_fp32_masters(reference):
    """Compute parameters bf16 (2 bytes each), gradients bf16 plus the fp32 ones the
    optimizer reads, masters and AdamW fp32: 2 + 6 + 12 bytes a parameter, measured."""
    fp32 = {"steps": 2, "dtype": "fp32"}
    cfgs = [tiny_config(train={**BF16, "steps": 2}), tiny_config(train=fp32)]
    bf16, fp32 = (r[0] for r in by_layout([train_and_measure(0, 1, [c.to_dict() for c in cfgs])]))
    psi, tensors = param_count(cfgs[0].model), len(bf16["state"])
    assert bf16["memory"][0] == bf16["memory"][1]
    assert bf16["memory"][0] == ModelState(2 * psi, 6 * psi, 12 * psi + 4 * tensors)
    assert fp32["memory"][0] == ModelState(4 * psi, 4 * psi, 8 * psi + 4 * tensors)
    assert all(t.dtype == torch.float32 for t in bf16["state"].values())  # the masters
    assert max_rel(reference(train=BF16)["losses"], reference()["losses"]) > BF16_VISIBLE


LAYOUTS = [
    {"dp": 2},
    {"dp": 2, "reduce_dtype": "bf16"},
    {"fsdp": 2, "zero_stage": 1},
    {"fsdp": 2, "zero_stage": 3, "microbatches": 2},
    {"tp": 2},
    {"tp": 2, "sp": True},
    {"pp": 2, "microbatches": 2},
    {"pp": 2, "microbatches": 2, "pp_schedule": "zb-h1"},
    {"fsdp": 2, "zero_stage": 2, "microbatches": 2},
    {"pp": 2, "microbatches": 2, "pp_schedule": "gpipe"},
]
# two stages a rank: 4 layers (held to the 4-layer single process)
MODEL4 = {"layers": 4}
LAYOUTS4 = [
    {"pp": 2, "microbatches": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 2},
    {"pp": 2, "microbatches": 2, "pp_schedule": "zb-v", "virtual_stages": 2},
]


def declare_jobs(jobs: Jobs) -> None:
    """Every layout in bf16, 2 ranks, 20 steps."""
    cfgs = [tiny_config(train=BF16, parallel=p) for p in LAYOUTS]
    cfgs += [tiny_config(model=MODEL4, train=BF16, parallel=p) for p in LAYOUTS4]
    jobs.add("every-axis", 2, train_and_measure, [c.to_dict() for c in cfgs])


@pytest.mark.distributed
@pytest.mark.rounding  # rerun on SSE4.2 kernels (scripts/test.sh)
def test_bf16_every_axis(reference, jobs):
    """dp (gradients reduced in fp32, or in bf16), ZeRO-1, -2 and -3, tp with and without
    sp, pp under GPipe, 1F1B, interleaved 1F1B and the zero-bubble schedules (zb-h1, zb-v):
    each on 2 ranks, 20 steps, against the bf16 single process of the same model."""
    results = by_layout(jobs["every-axis"])
    for layout, ranks in zip(LAYOUTS, results[: len(LAYOUTS)], strict=True):
        check_bf16(layout, ranks, reference(train=BF16), reference())
    for layout, ranks in zip(LAYOUTS4, results[len(LAYOUTS) :], strict=True):
        check_bf16(layout, ranks, reference(model=MODEL4, train=BF16), reference(model=MODEL4))


def test_bf16_resume_is_exact(reference, tmp_path):
    """Checkpoints hold the fp32 masters and their AdamW state: a bf16 run stopped after
    10 steps and resumed continues exactly as the straight run (the bf16 parameters are
    the masters' rounding either way)."""
    from tetrad.mesh import Mesh
    from tetrad.train.loop import Trainer

    def trainer(resume: bool) -> Trainer:
        cfg = tiny_config(
            train={**BF16, "out": str(tmp_path)}, checkpoint={"every": 10, "resume": resume}
        )
        return Trainer(cfg, Mesh.build(cfg.parallel, 0), torch.device("cpu"))

    trainer(False).fit(stop=10)
    resumed = trainer(True)
    assert resumed.resume() == 10
    rows = resumed.fit()
    straight = reference(train=BF16)
    assert [r["loss"] for r in rows] == straight["losses"][10:]
    for name, value in resumed.engine.full_state_dict().items():
        assert torch.equal(value, straight["state"][name]), name
