"""scripts/gpu_check.py's CPU-side parts: flags, the plan of parts, judging, the JSON writer."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts/gpu_check.py")
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc  # dataclasses look their module up there
_spec.loader.exec_module(gc)


def test_defaults():
    args = gc.parse_args([])
    assert (args.out, args.steps, args.layout_steps, args.gpus) == ("gpu_check.json", 50, 8, None)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--steps", "5"], ["--steps 5", ">= 12"]),
        (["--layout-steps", "0"], ["--layout-steps 0"]),
        (["--gpus", "0"], ["--gpus must be >= 1, got 0"]),
        (["--rtol", "0"], ["--rtol must be > 0"]),
        (["--mfu-floor", "1.5"], ["--mfu-floor 1.5"]),
        (["--memory-tol", "0"], ["--memory-tol 0"]),
    ],
)
def test_bad_flags_name_the_values(argv, words):
    with pytest.raises(ValueError) as err:
        gc.parse_args(argv)
    for w in words:
        assert w in str(err.value)


def test_bad_flags_exit_2_with_a_message(capsys):
    assert gc.main(["--gpus", "-1"]) == 2
    assert "gpu_check: error: --gpus must be >= 1, got -1" in capsys.readouterr().err


@pytest.mark.distributed  # starts the script's process
def test_without_a_gpu_it_says_so(tmp_path):
    """On this machine (no GPU) the script refuses plainly instead of guessing figures."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if proc.returncode != 2:
        pytest.skip("a GPU is visible: the script would run for real")
    assert "no CUDA device is visible" in proc.stderr


def test_parts_on_one_and_two_gpus(tmp_path):
    args = gc.parse_args(["--steps", "50"])
    one, skipped = gc.plan_parts(args, 1, tmp_path)
    assert [p.name for p in one] == [
        "cuda_tests", "train_bf16_100m", "train_bf16_100m_compiled", "train_bf16_100m_fp8",
        "moe_grouped_mm",
    ]  # fmt: skip
    assert one[4].argv[1:] == [str(ROOT / "scripts/gpu_check_moe.py"), "--json",
                               str(tmp_path / "moe.json")]  # fmt: skip
    fp8 = one[3].argv  # the eager run's command in FP8, in a directory of its own
    assert fp8[: fp8.index("--out")] == [*one[1].argv[: one[1].argv.index("--out")],
                                         "--fp8", "tensorwise"]  # fmt: skip
    compiled = one[2].argv  # the eager run's command, compiled, in a directory of its own
    assert compiled[: compiled.index("--out")] == [*one[1].argv[: one[1].argv.index("--out")],
                                                     "--compile"]  # fmt: skip
    assert compiled[-1] != one[1].argv[-1]
    assert "need 2 GPUs, this machine has 1" in skipped[0]
    bf16 = one[1].argv
    assert bf16[bf16.index("--dtype") + 1] == "bf16" and bf16[bf16.index("--steps") + 1] == "50"
    two, skipped = gc.plan_parts(gc.parse_args(["--skip-tests"]), 2, tmp_path)
    names = [p.name for p in two]
    layouts = ("dp", "fsdp", "tp", "pp-1f1b", "pp-zb-h1", "pp-interleaved", "cp-ring")
    assert names == [
        "train_bf16_100m",
        "train_bf16_100m_compiled",
        "train_bf16_100m_fp8",
        "moe_grouped_mm",
        "layout_single",
    ] + [f"layout_{n}" for n in layouts] + ["bench_comm"]
    assert skipped[0] == "cuda_tests: --skip-tests" and "ep all-to-all" in skipped[1]
    assert "--peak-tflops" not in two[0].argv  # a declared peak: the trainer's own
    measured, _ = gc.plan_parts(args, 1, tmp_path, peak=512.34)
    bf16 = measured[1].argv
    assert bf16[bf16.index("--peak-tflops") + 1] == "512.3"
    # every part has a timeout, so a hang is reported: on one GPU 18 minutes at most
    assert sum(p.timeout_s for p in one) <= 18 * 60 and sum(p.timeout_s for p in two) <= 29 * 60
    for p in two[5:-1]:  # every layout runs the same job on 2 ranks as the single GPU
        assert p.argv[p.argv.index("--nproc") + 1] == "2"
        assert p.argv[p.argv.index("--global-batch") + 1] == "8"


def test_the_100m_model_is_100m():
    from tetrad.cli import build_config, parser
    from tetrad.models.flops import param_count

    args = parser().parse_args(["train", *gc.MODEL_100M])
    assert 100e6 <= param_count(build_config(args).model) <= 130e6


def test_judging_runs():
    rows = [
        {"loss": 5.0 - i * 0.01, "tokens_per_s": 1000.0 + i, "mfu": 0.3, "step_time_s": 0.1,
         "peak_mem_bytes": 2**30 + i}
        for i in range(50)
    ]  # fmt: skip
    t = gc.throughput(rows)
    assert t["tokens_per_s"] == 1000.0 + 29.5 and t["peak_mem_bytes"] == 2**30 + 49 and t["finite"]
    assert "error" in gc.throughput(rows[:5])
    assert not gc.throughput([{**rows[0], "loss": float("nan")}] * 12)["finite"]
    ok = gc.compare_losses([2.0, 1.0], [2.0, 1.00005], rtol=1e-4)
    assert ok["ok"] and ok["max_rel_diff"] == pytest.approx(5e-5)
    assert not gc.compare_losses([2.0, 1.0], [2.0, 1.001], rtol=1e-4)["ok"]
    assert not gc.compare_losses([2.0, 1.0], [2.0], rtol=1e-4)["ok"]


def test_the_bf16_run_is_judged_on_mfu_and_memory():
    limits = gc.thresholds(gc.parse_args([]))
    assert limits == {"mfu_floor": 0.10, "memory_tol": 0.10, "loss_rtol": 1e-4}
    good = {"finite": True, "steps": 50, "mfu": 0.31, "memory": {"measured_over_predicted": 1.04}}
    assert gc.judge_bf16(good, 50, limits) == {"ok": True, "failed": []}
    slow = gc.judge_bf16({**good, "mfu": 0.04}, 50, limits)
    assert not slow["ok"] and "MFU 0.04 under the floor 0.1" in slow["failed"][0]
    fat = gc.judge_bf16({**good, "memory": {"measured_over_predicted": 1.2}}, 50, limits)
    assert not fat["ok"] and "1.200x the plan's" in fat["failed"][0]
    thin = gc.judge_bf16({**good, "memory": {"measured_over_predicted": 0.85}}, 50, limits)
    assert not thin["ok"]
    unplanned = gc.judge_bf16({**good, "memory": {"error": "no planner preset"}}, 50, limits)
    assert not unplanned["ok"] and "not compared" in unplanned["failed"][0]
    assert not gc.judge_bf16({**good, "steps": 49}, 50, limits)["ok"]


def test_the_compiled_run_is_judged_on_recompiles():
    rows = [{"loss": 5.0, "tokens_per_s": 2000.0, "mfu": 0.4, "step_time_s": 0.1,
             "peak_mem_bytes": 1, "compile_s": 30.0 if i == 0 else 0.0, "recompiles": 0}
            for i in range(50)]  # fmt: skip
    eager = {"tokens_per_s": 1000.0, "mfu": 0.2}
    good = gc.judge_compiled(gc.throughput(rows), rows, eager)
    assert good["ok"] and good["speedup_over_eager"] == 2.0 and good["compile_s"] == 30.0
    assert good["eager_mfu"] == 0.2 and good["recompiles_after_first_step"] == 0
    rows[20]["recompiles"] = 3
    bad = gc.judge_compiled(gc.throughput(rows), rows, eager)
    assert not bad["ok"] and "3 recompilations after the first step" in bad["failed"]


def test_the_fp8_run_is_judged_against_bf16():
    rows = [{"loss": 5.0, "tokens_per_s": 1500.0, "mfu": 0.3, "step_time_s": 0.1,
             "peak_mem_bytes": 1} for _ in range(50)]  # fmt: skip
    got = gc.judge_variant(gc.throughput(rows), {"tokens_per_s": 1000.0, "mfu": 0.2}, "bf16")
    assert got["ok"] and got["speedup_over_bf16"] == 1.5 and got["bf16_mfu"] == 0.2
    rows[30]["loss"] = float("nan")
    assert not gc.judge_variant(gc.throughput(rows), {"mfu": 0.2}, "bf16")["ok"]


def test_the_moe_part_runs_both_ways_and_judges(tmp_path, capsys):
    """scripts/gpu_check_moe.py on CPU, tiny: the path is the grouped kernel, equal to the
    loop within its bound, the empty expert's gradients zero, times of both; the JSON it
    writes is the part's result. A bound it cannot meet fails it."""
    path = ROOT / "scripts/gpu_check_moe.py"
    spec = importlib.util.spec_from_file_location("gpu_check_moe", path)
    gm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gm)
    tiny = ["--device", "cpu", "--experts", "4", "--tokens", "32", "--dim", "32", "--ffn", "48"]
    out = tmp_path / "moe.json"
    assert gm.main([*tiny, "--rounds", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    kernel = hasattr(torch, "_grouped_mm")  # the floor torch's has none: the loop, equal
    assert r["ok"] and r["path"] == ("grouped_mm" if kernel else "loop")
    assert (r["loop_reason"] is None) == kernel
    assert r["group_sizes"][-1] == 0 and r["empty_expert_grad_max"] == 0
    assert set(r["max_abs_diff_vs_loop"]) == {"out", "dx", "dw1", "dw3", "dw2"}
    assert r["fwd_bwd_ms"]["path"] > 0 and r["fwd_bwd_ms"]["loop"] > 0
    part = gc.Part("moe_grouped_mm", [], 60, {"ok": True})
    gc.evaluate(part, tmp_path, gc.parse_args([]), "cpu")
    assert part.result["path"] == r["path"] and part.result["ok"]
    assert gm.main([*tiny, "--top-k", "4"]) == 2  # the last expert must stay empty
    capsys.readouterr()
    experts, x, counts, grad = gm.problem(gm.parse_args(tiny))
    got = gm.forward_backward(experts, x, counts, grad, gm.grouped_linear)
    wrong = [got[0] + 1, *got[1:]]
    assert "out:" in gm.judge(wrong, got, [t.double() for t in got], x.dtype)["failed"][0]


def test_junit_counts(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" tests="7">'
        "</testsuite></testsuites>"
    )
    assert gc.junit_counts(xml) == {
        "tests": 7, "failures": 1, "errors": 0, "skipped": 2, "passed": 4
    }  # fmt: skip


def test_summary_and_writer(tmp_path):
    parts = [gc.Part("a", [], 1, {"ok": True}), gc.Part("b", [], 1, {"ok": False, "error": "x"})]
    limits = gc.thresholds(gc.parse_args([]))
    s = gc.summarize({"gpus": ["NVIDIA H100"]}, parts, ["layouts: need 2 GPUs"], 12.34, limits)
    assert s["thresholds"] == limits
    assert s["ok"] is False and s["results"]["b"]["error"] == "x" and s["seconds"] == 12.3
    assert gc.summarize({}, parts[:1], [], 1.0)["ok"] is True
    assert gc.summarize({}, [], [], 1.0)["ok"] is False  # nothing ran: nothing passed
    path = tmp_path / "deep" / "gpu_check.json"
    gc.write_summary(path, s)
    assert json.loads(path.read_text()) == s
    assert not list(path.parent.glob("*.tmp"))


def test_script_is_executable_and_calls_the_driver():
    sh = ROOT / "scripts/gpu_check.sh"
    assert sh.stat().st_mode & 0o111
    assert "scripts/gpu_check.py" in sh.read_text()
    assert sys.executable  # the driver runs under the project's interpreter
