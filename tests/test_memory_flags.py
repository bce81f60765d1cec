"""--recompute, --loss-chunk and --dtype bf16: bad values refused before any process starts,
with the value named; a bf16 CLI run writes the measured memory figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import tiny_config
from tetrad.layout import Layout


@pytest.mark.parametrize(
    "train,needle",
    [
        ({"recompute": "some"}, "train.recompute='some'"),
        ({"loss_chunk": -1}, "train.loss_chunk=-1"),
        ({"meter_every": -1}, "train.meter_every=-1"),
    ],
)
def test_bad_memory_settings_name_the_value(train, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        Layout.build(tiny_config(train=train))


def _tetrad(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tetrad.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_cli_refuses_a_negative_loss_chunk_before_launching(tmp_path, capsys):
    from tetrad.cli import main

    assert main(["train", "--nproc", "2", "--loss-chunk", "-5", "--out", str(tmp_path)]) == 2
    assert "tetrad: error: train.loss_chunk=-5" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--recompute", "most"])
    assert exit_.value.code == 2 and "invalid choice: 'most'" in capsys.readouterr().err


def test_cli_bf16_recompute_writes_measured_memory(tmp_path):
    res = _tetrad(
        "train", "--nproc", "1", "--layers", "2", "--dim", "32", "--heads", "4",
        "--kv-heads", "2", "--vocab", "64", "--seq-len", "16", "--global-batch", "4",
        "--steps", "2", "--data", "synthetic", "--no-progress", "--dtype", "bf16",
        "--recompute", "full", "--loss-chunk", "16", "--out", str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["peak_activation_bytes"] > 0 for r in rows)
    assert all(r["model_state_bytes"] == r["model_state_predicted_bytes"] for r in rows)
    config = json.loads((tmp_path / "config.json").read_text())["train"]
    assert (config["dtype"], config["recompute"], config["loss_chunk"]) == ("bf16", "full", 16)


@pytest.mark.parametrize(
    "train,needle",
    [
        ({"recompute": "some"}, "train.recompute='some'"),
        ({"loss_chunk": -1}, "train.loss_chunk=-1"),
    ],
)
def test_every_rank_refuses_before_joining_the_group(monkeypatch, train, needle):
    """A rank started by torchrun (here rank 1 of 2, no peer to meet) validates before it
    joins the process group (`run` builds its Layout first): the error comes at once, not a
    rendezvous hang."""
    from tetrad.train import loop
    from tetrad.train.run import run

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    joined = []
    monkeypatch.setattr(loop.dist, "rendezvous", lambda *a, **k: joined.append(a) or iter(()))
    with pytest.raises(ValueError, match=needle):
        run(tiny_config(parallel={"dp": 2}, train=train))
    assert not joined
