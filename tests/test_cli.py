"""The `tetrad` command end to end, in subprocesses (torchrun included); what is refused
before any process starts, in this one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tetrad.cli import main as cli_main
from tetrad.config import Config

TINY = [
    "--layers", "2", "--dim", "32", "--heads", "4", "--kv-heads", "2", "--vocab", "64",
    "--seq-len", "16", "--global-batch", "8", "--steps", "20", "--data", "synthetic",
    "--no-progress",
]  # fmt: skip
KEYS = {
    "step", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s", "mfu",
    "peak_mem_bytes", "comm_bytes", "skipped",
}  # fmt: skip


def tetrad(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tetrad.cli", *args], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_train_dp2_matches_single_process(tmp_path, monkeypatch, capfd):
    """The default launch (no degree given: two data-parallel processes) equals one
    process, and leaves a model to sample from, saying where (the newcomer's first run)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    one_out, two_out = tmp_path / "n1", tmp_path / "n2"
    assert cli_main(["train", "--nproc", "1", "--out", str(one_out), *TINY]) == 0  # here
    res = tetrad("train", "--out", str(two_out), *TINY)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"writing the run to {two_out}/" in res.stdout
    assert f"tetrad generate {two_out}" in res.stdout and f"tetrad report {two_out}" in res.stdout
    assert json.loads((two_out / "config.json").read_text())["parallel"]["dp"] == 2
    assert (two_out / "checkpoints" / "step_00000020" / "manifest.json").is_file()
    capfd.readouterr()
    assert cli_main(["generate", str(two_out), "--prompt", "01", "--max-new-tokens", "4"]) == 0
    assert capfd.readouterr().out.strip()
    one, two = read_metrics(one_out), read_metrics(two_out)
    assert len(one) == len(two) == 20
    for row in one + two:
        assert row.keys() >= KEYS
    assert [r["step"] for r in two] == list(range(20))
    assert all(not r["skipped"] for r in two)
    assert two[0]["comm_bytes"] > 0 and one[0]["comm_bytes"] == 0
    assert [r["tokens"] for r in one] == [r["tokens"] for r in two]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=0)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5, abs=0)
    assert one[-1]["loss"] < one[0]["loss"]  # it learns


@pytest.mark.parametrize(
    "args,message",
    [
        (["--nproc", "4", "--dp", "2"], "world size 4 != dp*fsdp*cp*tp*pp = 2*1*1*1*1 = 2"),
        (["--nproc", "1", "--heads", "3"], "model.dim=32 is not divisible by heads=3"),
        (["--nproc", "1", "--global-batch", "6", "--microbatches", "4"], "global_batch=6"),
    ],
)
def test_bad_config_fails_fast(args, message, tmp_path, capfd):
    assert cli_main(["train", *TINY, "--out", str(tmp_path), *args]) != 0
    assert message in capfd.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_toml_fails_fast(tmp_path, capfd):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\nlayerz = 2\n")
    assert cli_main(["train", "--config", str(path)]) != 0
    assert "unknown key 'layerz' in [model]" in capfd.readouterr().err


def test_help():
    res = tetrad("train", "--help", timeout=60)
    assert res.returncode == 0
    for flag in ("--nproc", "--dp", "--fsdp", "--tp", "--pp", "--global-batch", "--data"):
        assert flag in res.stdout
    with pytest.raises(SystemExit) as end:
        cli_main(["bench", "--help"])
    assert end.value.code == 0


# config fields settable only in a --config file; every other field is an option of
# `tetrad train`, declared once, by its `cli` metadata (config.py)
CONFIG_ONLY = {
    "model": {"name", "family", "ffn_dim", "max_seq_len", "rope_theta", "norm_eps", "init_std",
              "head_size", "qk_norm", "bias_rate", "capacity_factor", "n_group", "topk_group",
              "routed_scaling", "norm_topk_prob", "q_lora_rank", "kv_lora_rank", "qk_nope_dim",
              "qk_rope_dim", "v_head_dim"},
    "parallel": {"reshard_after_forward", "elastic"},
    "train": {"min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip"},
    "data": {"max_bytes"},
    "checkpoint": {"keep"},
}  # fmt: skip


def train_parser():
    from tetrad.cli import parser

    return parser()._subparsers._group_actions[0].choices["train"]


def test_every_config_field_is_an_option_declared_once():
    """A new config field is either an option (with its help in `cli` metadata) or listed
    above as config-only; no flag is declared twice."""
    from dataclasses import fields

    from tetrad.cli import TRAIN_OPTIONS

    cfg = Config()
    for section in fields(cfg):
        for f in fields(getattr(cfg, section.name)):
            meant = f.name not in CONFIG_ONLY[section.name]
            assert ("cli" in f.metadata) == meant, f"{section.name}.{f.name}"
            if meant:
                assert f.metadata["cli"]["help"], f"{section.name}.{f.name} has no help"
    assert {(s, f.name) for s, f in TRAIN_OPTIONS.values()} == {
        (s.name, f.name)
        for s in fields(cfg)
        for f in fields(getattr(cfg, s.name))
        if f.name not in CONFIG_ONLY[s.name]
    }
    flags = [o for a in train_parser()._actions for o in a.option_strings]
    assert len(flags) == len(set(flags))
    assert all(a.help for a in train_parser()._actions), "an option without help"


def test_a_flag_declared_twice_is_refused(monkeypatch):
    from dataclasses import fields

    from tetrad.cli import config_options
    from tetrad.config import TrainConfig

    seed = next(f for f in fields(TrainConfig) if f.name == "seed")
    monkeypatch.setattr(seed, "metadata", {"cli": {**seed.metadata["cli"], "flag": "steps"}})
    with pytest.raises(ValueError, match="--steps is declared twice: train.steps, train.seed"):
        config_options()


def test_flags_override_the_config_file(tmp_path):
    """Flags beat the --config file; bool flags set the opposite of the default (--no-X
    forms included); --dp auto makes dp the elastic degree."""
    from tetrad.cli import build_config

    path = tmp_path / "c.toml"
    path.write_text("[parallel]\ntp = 2\nzero_stage = 1\n[train]\nsteps = 5\nprogress = true\n")
    argv = ["train", "--config", str(path), "--steps", "7", "--data", "synthetic", "--sp",
            "--no-progress", "--no-final-checkpoint", "--async-checkpoint", "--dp", "auto",
            "--pp-schedule", "zb-h1", "--checkpoint-every", "3", "--lr", "1e-3"]  # fmt: skip
    cfg = build_config(train_parser().parse_args(argv[1:]))
    assert (cfg.parallel.tp, cfg.parallel.zero_stage, cfg.parallel.sp) == (2, 1, True)
    assert (cfg.parallel.dp, cfg.parallel.elastic, cfg.parallel.pp_schedule) == (1, "dp", "zb-h1")
    assert (cfg.train.steps, cfg.train.lr, cfg.train.progress) == (7, 1e-3, False)
    assert (cfg.data.source, cfg.checkpoint.every) == ("synthetic", 3)
    assert not cfg.checkpoint.final and cfg.checkpoint.async_save and not cfg.checkpoint.resume
    expected = Config()
    expected.data.source = "synthetic"
    assert build_config(train_parser().parse_args(["--data", "synthetic"])) == expected
    with pytest.raises(SystemExit):
        train_parser().parse_args(["--tp", "auto"])  # only dp and fsdp follow the world


def test_experts_flag_keeps_a_mixtures_own_family():
    from tetrad.cli import experts_family

    assert experts_family("llama", 8) == "moe" and experts_family("qwen3", 4) == "moe"
    assert experts_family("moe", 0) == "llama"
    assert experts_family("deepseek_v3", 16) == "deepseek_v3"  # not turned into plain MoE
    assert experts_family("moe", 8) == "moe"
