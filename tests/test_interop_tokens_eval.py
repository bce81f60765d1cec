"""Real tokenizers, token files read in epochs, held-out evaluation, TensorBoard, report.

Oracles: an epoch visits every training window exactly once and never a held-out one;
`data prepare` round-trips the text through the tokenizer; a token file made with another
tokenizer, or a tokenizer larger than the model, fails naming both; eval_loss is the same
in every layout and evaluating does not change training; the README's flow (import,
prepare, train, export) gives a directory transformers loads with tetrad's logits.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import Jobs, tiny_config, trainer_for
from tetrad.cli import main as cli_main
from tetrad.config import from_dict
from tetrad.train.data import Loader, make_source

tokenizers = pytest.importorskip("tokenizers")


def corpus_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"]) / "json"
    return (root / "decoder.py").read_text() + (root / "encoder.py").read_text()


def train_bpe(path: Path, vocab: int = 300, text: str | None = None) -> Path:
    """A small byte-level BPE trained on a few kilobytes of text, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([text or corpus_text()], trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def prepare(d: Path) -> tuple[Path, Path, str]:
    """(tokenizer.json, token file, text) made by `tetrad data prepare` in `d` (once)."""
    text, tok, out = corpus_text(), d / "tok" / "tokenizer.json", d / "corpus.u16"
    if not out.exists():
        (d / "corpus.txt").write_text(text)
        train_bpe(d / "tok")
        assert cli_main(["data", "prepare", str(d / "corpus.txt"), "--tokenizer", str(tok),
                         "--out", str(out)]) == 0  # fmt: skip
    return tok, out, text


@pytest.fixture(scope="module")
def prepared(jobs):
    """The prepared tokenizer, token file and text (made once, for the jobs too)."""
    return prepare(jobs.tmp("tokens"))


def test_prepare_writes_tokens_and_sidecar(prepared):
    tok_path, out, text = prepared
    tok = tokenizers.Tokenizer.from_file(str(tok_path))
    ids = np.fromfile(out, dtype=np.uint16)
    info = json.loads(out.with_name(out.name + ".json").read_text())
    assert info["tokens"] == len(ids) and info["vocab_size"] == tok.get_vocab_size() == 300
    assert info["tokenizer_sha256"] == hashlib.sha256(tok_path.read_bytes()).hexdigest()
    assert tok.decode(ids.tolist()) == text  # byte-level BPE: lossless
    assert len(ids) < 0.8 * len(text.encode())  # merges (44 of them), not bytes


def test_an_epoch_visits_each_training_window_once(prepared):
    _, out, _ = prepared
    B, S, held = 8, 16, 16
    src = make_source(str(out), 300, 0, 1 << 30, B, S, heldout=held)
    n = src.windows
    tokens = np.fromfile(out, dtype=np.uint16)
    assert n == (len(tokens) - held * S - 2) // S
    steps = -(-2 * n // B)  # two epochs and a bit
    loader = Loader(src, B, S, 0, 1, 1)
    starts = []
    for k in range(steps):
        for mb in loader.batch(k):
            for row in range(mb.inputs.shape[0]):
                order = src.order((k * B + row) // n)
                starts.append(int(order[(k * B + row) % n]))
    first, second = starts[:n], starts[n : 2 * n]
    assert sorted(first) == sorted(second) == list(range(n))  # no repetition within an epoch
    assert first != second  # each epoch its own order
    assert src.epochs(steps) == pytest.approx(steps * B / n)
    # the order is a function of (seed, epoch): another source object agrees
    again = make_source(str(out), 300, 0, 1 << 30, B, S, heldout=held)
    assert np.array_equal(again.order(1), src.order(1))
    # held-out windows start after every training target: no token is in both
    heldout = src.heldout_split()
    last_train_target = n * S
    for i in range(held):
        inputs, targets = heldout.sequence(0, i, S)
        start = src.eval_start + i * S
        assert start > last_train_target
        assert np.array_equal(inputs.numpy(), tokens[start : start + S])


def test_wrong_tokenizer_and_too_small_model_fail_naming_both(prepared, tmp_path):
    tok, out, text = prepared
    other = train_bpe(tmp_path / "other", vocab=280, text=text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"corpus.u16 was made with tokenizer .*tok/tokenizer"):
        make_source(str(out), 300, 0, 1 << 30, 8, 16, tokenizer=str(other))
    with pytest.raises(ValueError, match=r"tokenizer of 300 tokens .* more than model.vocab=256"):
        make_source(str(out), 256, 0, 1 << 30, 8, 16)
    with pytest.raises(
        ValueError, match=r"tokenizer.json has 300 tokens, more than model.vocab=256"
    ):
        make_source(str(tmp_path), 256, 0, 1 << 30, 8, 16, tokenizer=str(tok))
    # text read through the tokenizer equals the prepared file
    (tmp_path / "c.txt").write_text(text)
    src = make_source(str(tmp_path / "c.txt"), 300, 0, 1 << 30, 8, 16, tokenizer=str(tok))
    assert np.array_equal(src.tokens, np.fromfile(out, dtype=np.uint16))
    # a .bin (nanoGPT's uint16 ids, no sidecar) is ids with a tokenizer too, not text
    (tmp_path / "c.bin").write_bytes(out.read_bytes())
    src = make_source(str(tmp_path / "c.bin"), 300, 0, 1 << 30, 8, 16, tokenizer=str(tok))
    assert np.array_equal(src.tokens, np.fromfile(out, dtype=np.uint16))


def _train_rows(rank: int, world: int, raws: list[dict]) -> list[list[dict]]:
    out = []
    for raw in raws:
        cfg = from_dict(raw)
        trainer = trainer_for(cfg, rank)
        out.append(trainer.fit())
    return out


EVAL = {"steps": 6, "eval_every": 3, "eval_batches": 2}
LAYOUTS = [
    {"dp": 2},
    {"tp": 2},
    {"pp": 2, "microbatches": 2, "pp_schedule": "1f1b"},
    {"fsdp": 2, "zero_stage": 3},
]


def _base(out: Path) -> dict:
    return {"data": {"source": str(out)}, "model": {"vocab": 300}}


def declare_jobs(jobs: Jobs) -> None:
    """Every layout trained and evaluated on the prepared token file: 2 ranks."""
    _, out, _ = prepare(jobs.tmp("tokens"))
    cfgs = [tiny_config(**_base(out), train=EVAL, parallel=p).to_dict() for p in LAYOUTS]
    jobs.add("every-layout", 2, _train_rows, cfgs)


@pytest.mark.distributed
def test_eval_loss_is_the_same_in_every_layout(prepared, jobs):
    _, out, _ = prepared
    base, ev, layouts = _base(out), EVAL, LAYOUTS
    got = jobs["every-layout"][0]
    other = ev | {"eval_every": 4}  # the same split, evaluated at other steps
    ref, other_evals = _train_rows(
        0, 1, [tiny_config(**base, train=ev).to_dict(), tiny_config(**base, train=other).to_dict()]
    )
    evals = [r["eval_loss"] for r in ref if "eval_loss" in r]
    assert [r["step"] for r in ref if "eval_loss" in r] == [2, 5] and evals[1] < evals[0]
    assert all(r["epoch"] > 0 for r in ref)
    for par, rows in zip(layouts, got):
        for key in ("loss", "eval_loss"):
            a = [r[key] for r in rows if key in r]
            b = [r[key] for r in ref if key in r]
            assert a == pytest.approx(b, rel=1e-5, abs=0), (par, key)
    # evaluating leaves training untouched: the same losses as a run that evaluates at
    # other steps (the same windows are held out: the split depends on eval_batches only)
    assert [r["step"] for r in other_evals if "eval_loss" in r] == [3, 5]
    assert [r["loss"] for r in ref] == [r["loss"] for r in other_evals]


def test_readme_flow_import_prepare_train_export(prepared, tmp_path, capsys):
    """The four README commands, then generate, report and the TensorBoard events."""
    transformers = pytest.importorskip("transformers")
    from test_interop_hf import hf_logits, save_hf_llama, tetrad_logits

    tok, _, text = prepared
    hf_dir = tmp_path / "hf"
    save_hf_llama(hf_dir, vocab_size=320)
    (tmp_path / "notes.txt").write_text(text)
    data, run, out = tmp_path / "notes.u16", tmp_path / "run", tmp_path / "out"
    assert cli_main(["data", "prepare", str(tmp_path / "notes.txt"), "--tokenizer", str(tok),
                     "--out", str(data)]) == 0  # fmt: skip
    train = [
        "train", "--init-from-hf", str(hf_dir), "--tokenizer", str(tok), "--data", str(data),
        "--nproc", "1", "--steps", "4", "--seq-len", "32", "--global-batch", "4",
        "--eval-every", "2", "--eval-batches", "1", "--checkpoint-every", "4", "--tensorboard",
        "--out", str(run), "--no-progress",
    ]  # fmt: skip
    assert cli_main(train) == 0
    assert cli_main(["export", str(run), "--hf", str(out)]) == 0
    # transformers reads the export: weights with tetrad's logits, the run's tokenizer
    from tetrad.train.checkpoint import load_model

    cfg, state = load_model(run)
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(
        hf_logits(out, tokens), tetrad_logits(cfg.model, state, tokens), rtol=0, atol=1e-5
    )
    # bf16 export: half the bytes, the source's special tokens carried over
    out16 = tmp_path / "out16"
    assert cli_main(["export", str(run), "--hf", str(out16), "--dtype", "bf16"]) == 0
    config = json.loads((out16 / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["eos_token_id"] == 2
    from safetensors.torch import load_file

    weights16 = load_file(out16 / "model.safetensors")
    assert {t.dtype for t in weights16.values()} == {torch.bfloat16}
    assert transformers.LlamaForCausalLM.from_pretrained(out16) is not None
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (
        hf_tok("def encode(self, o):")["input_ids"]
        == tokenizers.Tokenizer.from_file(str(tok)).encode("def encode(self, o):").ids
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [1, 3]
    # generate: seeded sampling is reproducible and continues the prompt in the run's tokenizer
    capsys.readouterr()
    assert cli_main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    first = capsys.readouterr().out
    assert cli_main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == first and first.startswith("def ")
    # report: the plots and a summary with the figures asked for
    assert cli_main(["report", str(run)]) == 0
    summary = (run / "report" / "summary.txt").read_text()
    for line in ("median tokens/s", "median MFU", "peak memory", "skipped steps        0"):
        assert line in summary
    for png in ("loss.png", "throughput.png", "memory.png", "comm.png", "optim.png"):
        assert (run / "report" / png).read_bytes()[:4] == b"\x89PNG"
    # TensorBoard: the same series as metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "train/lr", "perf/mfu", "comm/bytes"} <= tags
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(
        [r["loss"] for r in rows]
    )
