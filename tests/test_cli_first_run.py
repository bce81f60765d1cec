"""A newcomer's first run: it leaves a model to sample from and says where, and a tokenizer
sets the vocabulary when none is given."""

from __future__ import annotations

import pytest

from tetrad.cli import build_config, parser
from tetrad.cli import main as cli_main

TINY = ["--model", "tiny", "--seq-len", "16", "--global-batch", "4", "--no-progress"]
ONE = [*TINY, "--nproc", "1"]  # in this process: what is tested is not the launch


def test_a_run_keeps_its_model_and_says_where(tmp_path, monkeypatch, capfd):
    """`tetrad train` saves the last step by default, names the run at its start and end,
    and `tetrad generate` then samples from it; --no-final-checkpoint keeps none. (Through
    the default two-process launch: test_cli's equivalence run.)"""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "run"
    assert cli_main(["train", *ONE, "--steps", "2", "--out", str(out)]) == 0
    said = capfd.readouterr().out
    assert f"writing the run to {out}/" in said
    assert f"tetrad generate {out}" in said and f"tetrad report {out}" in said
    assert (out / "checkpoints" / "step_00000002" / "manifest.json").is_file()
    assert cli_main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    bare = tmp_path / "bare"
    assert (
        cli_main(["train", *ONE, "--steps", "1", "--out", str(bare), "--no-final-checkpoint"]) == 0
    )
    assert not (bare / "checkpoints").exists()
    assert "tetrad generate" not in capfd.readouterr().out


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A 300-token tokenizer and a token file `tetrad data prepare` made with it."""
    pytest.importorskip("tokenizers")
    from test_interop_tokens_eval import corpus_text, train_bpe

    d = tmp_path_factory.mktemp("bpe")
    (d / "notes.txt").write_text(corpus_text())
    tok = train_bpe(d / "tok")
    out = d / "notes.u16"
    argv = ["data", "prepare", str(d / "notes.txt"), "--tokenizer", str(tok), "--out", str(out)]
    assert cli_main(argv) == 0
    return tok, out, d / "notes.txt"


@pytest.mark.parametrize(
    "flags, vocab",
    [
        ([], 384),  # 300 tokens, padded to a multiple of 128
        (["--tp", "2"], 512),  # ... of 128 * tp
        (["--vocab", "320"], 320),  # given: kept
    ],
)
def test_the_vocabulary_comes_from_the_token_file(bpe, flags, vocab):
    _, tokens, _ = bpe
    args = parser().parse_args(["train", "--data", str(tokens), *flags])
    cfg = build_config(args)
    assert cfg.model.vocab == vocab
    assert ("vocabulary 384" in args.vocab_note) == (vocab == 384)


def test_the_vocabulary_comes_from_the_tokenizer(bpe, tmp_path, capfd, monkeypatch):
    """Text through --tokenizer trains with no --vocab (it did not: 'more than
    model.vocab=256'); the run's first line says what it chose; a --vocab too small for
    the tokenizer stays an error naming both."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    tok, _, text = bpe
    argv = ["train", *ONE, "--steps", "1", "--data", str(text), "--tokenizer", str(tok)]
    assert cli_main([*argv, "--out", str(tmp_path / "a"), "--no-final-checkpoint"]) == 0
    assert capfd.readouterr().out.startswith("tetrad: vocabulary 384 from tokenizer")
    assert cli_main([*argv, "--out", str(tmp_path / "b"), "--vocab", "256"]) == 2
    assert "300 tokens, more than model.vocab=256" in capfd.readouterr().err
