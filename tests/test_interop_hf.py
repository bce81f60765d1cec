"""Hugging Face Llama in and out, checked against transformers itself (offline).

Oracles: a random `LlamaForCausalLM` saved by transformers, imported into tetrad, gives
HF's logits; a tetrad model exported and loaded by `from_pretrained` gives tetrad's; an
import trained 5 steps at dp 2 x tp 2 (and pp 2 x tp 2, fsdp 2 x tp 2) gives the
single-process losses, and its export gives tetrad's logits in transformers.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from harness import Jobs, tiny_config, trainer_for
from tetrad.cli import main as cli_main
from tetrad.config import from_dict
from tetrad.interop import hf
from tetrad.layout import Layout
from tetrad.models.init import build_model
from tetrad.models.llama import meta_llama

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-5  # float32 round-off on logits of magnitude ~1-5


def save_hf_llama(path, tie: bool = False, seed: int = 0, **overrides) -> None:
    """A small random GQA Llama, saved by transformers (weights scaled up so that the logits
    are of order one and a wrong permutation could not hide in round-off)."""
    shape = dict(
        vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=0.15,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(shape | overrides)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # gains other than 1 test the norm mapping too
    model.save_pretrained(path)


def hf_logits(path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


def tetrad_logits(model_cfg, state: dict, tokens: torch.Tensor) -> torch.Tensor:
    model = meta_llama(model_cfg).to_empty(device="cpu")
    model.load_state_dict(state)
    with torch.no_grad():
        return model(tokens)


def imported(path, **train) -> tuple:
    """(config, full state) of a single-process trainer started from `path`."""
    cfg = tiny_config(train=train)
    cfg.model = hf.model_config(path)
    trainer = trainer_for(cfg, 0)
    return cfg, trainer.engine.full_state_dict()


@pytest.mark.parametrize("tie", [False, True], ids=["gqa", "gqa-tied"])
def test_import_gives_hf_logits(tmp_path, tie):
    save_hf_llama(tmp_path, tie=tie)
    cfg, state = imported(tmp_path)
    assert cfg.model.tie_embeddings == tie and ("output.weight" in state) != tie
    assert (cfg.model.kv_heads, cfg.model.rope_theta, cfg.model.ffn_dim) == (2, 5000.0, 80)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    ours, theirs = tetrad_logits(cfg.model, state, tokens), hf_logits(tmp_path, tokens)
    assert theirs.abs().max() > 1  # not a near-zero model that any mapping would pass
    torch.testing.assert_close(ours, theirs, rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("tie", [False, True], ids=["gqa", "gqa-tied"])
def test_export_loads_in_hf_with_the_same_logits(tmp_path, tie):
    cfg = tiny_config(model={"vocab": 96, "tie_embeddings": tie, "rope_theta": 500.0})
    cfg.model.init_std = 0.2
    state = {n: p.detach() for n, p in build_model(cfg.model, seed=3).named_parameters()}
    # a shard limit below the model's size: several files and an index
    files = hf.save(state, cfg.model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / hf.INDEX).read_text())
    shards = {f.name for f in files if f.name.startswith("model-")}
    assert len(shards) > 1 and set(index["weight_map"].values()) == shards
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf_cfg.num_key_value_heads == 2 and hf_cfg.tie_word_embeddings == tie
    assert hf_cfg.intermediate_size == cfg.model.hidden_dim
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    theirs = hf_logits(tmp_path, tokens)
    assert theirs.abs().max() > 1
    torch.testing.assert_close(
        tetrad_logits(cfg.model, state, tokens), theirs, rtol=0, atol=LOGIT_ATOL
    )
    # and back: importing the export gives the same tensors
    back = hf.HFWeights(tmp_path, hf.model_config(tmp_path))
    for name, t in state.items():
        assert torch.equal(back[name][...], t), name


def test_lazy_slices_are_slices_of_the_full_tensor(tmp_path):
    save_hf_llama(tmp_path)
    weights = hf.HFWeights(tmp_path, hf.model_config(tmp_path))
    for name in ("layers.0.attention.wq.weight", "layers.1.attention.wk.weight",
                 "layers.0.attention.wv.weight"):  # fmt: skip
        full = weights[name][...]
        for index in [(slice(8, 24),), (slice(0, 8), slice(16, 32)), (slice(3, 13),),
                      (slice(1, 15, 2), slice(0, 8))]:  # fmt: skip
            assert torch.equal(weights[name][index], full[index]), (name, index)


def _import_and_train(rank: int, world: int, raw: list[dict]) -> list[dict]:
    """Train each config on this rank, counting the elements read from the HF files."""
    from tetrad.parallel.local import planned

    read = [0]
    original = hf.HFWeights.read

    def counted(self, name, index):
        t = original(self, name, index)
        read[0] += t.numel()
        return t

    hf.HFWeights.read = counted
    out = []
    try:
        for cfg_raw in raw:
            cfg = from_dict(cfg_raw)
            read[0] = 0
            trainer = trainer_for(cfg, rank)
            local = planned(Layout.build(cfg), cfg.model, rank).model  # tp, pp slices
            held = sum(p.numel() for p in local.parameters())
            rows = trainer.fit()
            state = trainer.engine.full_state_dict()
            out.append(
                {
                    "losses": [r["loss"] for r in rows],
                    "state": state if rank == 0 else None,
                    "read": read[0],
                    "held": held,
                }
            )
    finally:  # the ranks may go on to other modules' jobs
        hf.HFWeights.read = original
    return out


LAYOUTS = [
    {"dp": 2, "tp": 2},
    {"pp": 2, "tp": 2, "microbatches": 2, "pp_schedule": "1f1b"},
    {"fsdp": 2, "tp": 2, "zero_stage": 3},
]


def _configs(root) -> list:
    """The layouts, each importing root/hf and writing its run to root/run<i>."""
    cfgs = []
    for i, par in enumerate(LAYOUTS):
        cfg = tiny_config(parallel=par, train={"steps": 5, "out": str(root / f"run{i}")})
        cfg.model = hf.model_config(root / "hf")
        cfg.checkpoint.every = 5 if i == 0 else 0
        cfgs.append(cfg)
    return cfgs


def declare_jobs(jobs: Jobs) -> None:
    """The import trained in three 4-rank layouts (the HF directory is made here)."""
    root = jobs.tmp("import")
    save_hf_llama(root / "hf")
    jobs.add("import", 4, _import_and_train, [c.to_dict() for c in _configs(root)])


@pytest.mark.distributed
def test_import_train_dp2_tp2_export(jobs):
    tmp_path = jobs.tmp("import")
    src, layouts, cfgs = tmp_path / "hf", LAYOUTS, _configs(tmp_path)
    ranks = jobs["import"]
    results = ranks[0]
    total = sum(p.numel() for p in meta_llama(cfgs[0].model).parameters())
    for rank in ranks:  # each rank read exactly its own tp and pp slices, no more
        for par, got in zip(layouts, rank):
            assert got["read"] == got["held"] < 0.6 * total, par
    ref_cfg = tiny_config(train={"steps": 5})
    ref_cfg.model = hf.model_config(src)
    (ref,) = _import_and_train(0, 1, [ref_cfg.to_dict()])
    for par, got in zip(layouts, results):
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0,
            msg=lambda m, par=par: f"{par}: {m}",
        )  # fmt: skip
    out = tmp_path / "exported"
    assert cli_main(["export", str(tmp_path / "run0"), "--hf", str(out)]) == 0
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))
    trained = results[0]["state"]
    ours = tetrad_logits(cfgs[0].model, trained, tokens)
    torch.testing.assert_close(hf_logits(out, tokens), ours, rtol=0, atol=LOGIT_ATOL)
    before = hf_logits(src, tokens)
    assert (ours - before).abs().max() > 1e-3  # training moved the weights


def test_bad_directories_fail_naming_the_file(tmp_path, capsys):
    good = tmp_path / "good"
    save_hf_llama(good)
    cfg = hf.model_config(good)

    def broken(name):
        d = tmp_path / name
        shutil.copytree(good, d)
        return d

    d = broken("gpt2")
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(raw | {"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        hf.model_config(d)
    with pytest.raises(ValueError, match="config.json is missing"):
        hf.model_config(tmp_path)
    d = broken("bin")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled .bin"):
        hf.HFWeights(d, cfg)
    d = broken("shards")
    weights = hf.HFWeights(good, cfg)
    (d / "model.safetensors").unlink()
    files = hf.save({n: weights[n][...] for n in weights}, cfg, d, max_shard_bytes=20_000)
    files[1].unlink()
    with pytest.raises(ValueError, match=f"{files[1].name}, which is missing"):
        hf.HFWeights(d, cfg)
    d = broken("shape")
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(raw | {"intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight has shape \(80, 32\), expected"):
        hf.HFWeights(d, hf.model_config(d))
    d = broken("dtype")
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(32, dtype=torch.int32)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight has dtype I32; expected a float"):
        hf.HFWeights(d, cfg)
    # a flag that contradicts config.json: the command fails before launching, naming both
    code = cli_main(["train", "--init-from-hf", str(good), "--layers", "3", "--nproc", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--layers=3 contradicts num_hidden_layers=2" in err and str(good) in err
    code = cli_main(["train", "--init-from-hf", str(good), "--model", "tiny", "--nproc", "1"])
    assert code == 2 and "--model tiny and --init-from-hf" in capsys.readouterr().err
