"""Token sources and the sharded, resumable loader (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tetrad.models.batch import IGNORE
from tetrad.train.data import (
    Loader,
    Synthetic,
    TokenStream,
    load_path,
    make_source,
    stdlib_corpus,
)

B, S = 8, 16


def loader(source, data_rank=0, data_ranks=1, microbatches=1) -> Loader:
    return Loader(source, B, S, data_rank, data_ranks, microbatches)


@pytest.fixture(scope="module")
def sources():
    return {
        "synthetic": Synthetic(vocab=64, seed=1),
        "stdlib": make_source("stdlib", 256, 1, 1 << 18, B, S),
    }


@pytest.mark.parametrize("kind", ["synthetic", "stdlib"])
def test_batch_of_step_k_does_not_depend_on_history(sources, kind):
    src = sources[kind]
    a = loader(src)
    for _ in range(3):
        a.next()
    after_three = a.next()[0]
    fresh = loader(src).batch(3)[0]
    assert torch.equal(after_three.inputs, fresh.inputs)
    assert torch.equal(after_three.targets, fresh.targets)
    assert not torch.equal(fresh.inputs, loader(src).batch(2)[0].inputs)


@pytest.mark.parametrize("kind", ["synthetic", "stdlib"])
@pytest.mark.parametrize("ranks,micro", [(2, 1), (4, 1), (2, 2), (1, 4), (4, 2)])
def test_layouts_split_the_same_global_batch(sources, kind, ranks, micro):
    src = sources[kind]
    whole = loader(src).batch(5)[0]
    parts = [mb for r in range(ranks) for mb in loader(src, r, ranks, micro).batch(5)]
    assert len(parts) == ranks * micro
    assert all(mb.inputs.shape == (B // (ranks * micro), S) for mb in parts)
    assert torch.equal(torch.cat([mb.inputs for mb in parts]), whole.inputs)
    assert torch.equal(torch.cat([mb.targets for mb in parts]), whole.targets)


class Recorder:
    """A source that records which sequence indices were asked for."""

    def __init__(self):
        self.asked: list[tuple[int, int]] = []

    def sequence(self, step, index, seq_len):
        self.asked.append((step, index))
        return torch.full((seq_len,), index), torch.full((seq_len,), index)


def test_data_ranks_read_disjoint_slices():
    seen = []
    for r in range(4):
        rec = Recorder()
        loader(rec, r, 4, 1).batch(0)
        seen.append({i for _, i in rec.asked})
    assert all(a.isdisjoint(b) for i, a in enumerate(seen) for b in seen[i + 1 :])
    assert set().union(*seen) == set(range(B))
    assert seen[1] == {2, 3}  # rank r takes [r*B/d, (r+1)*B/d)


def test_resume_from_state_dict(sources):
    src = sources["stdlib"]
    a = loader(src, 1, 2, 2)
    for _ in range(4):
        a.next()
    state = a.state_dict()
    assert state == {"step": 4}
    b = loader(src, 1, 2, 2)
    b.load_state_dict(state)
    for x, y in zip(a.next(), b.next()):
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
    assert a.step == b.step == 5


def test_stdlib_corpus_is_real_bytes():
    data = stdlib_corpus(1 << 16)
    assert data.dtype == np.uint8 and len(data) == 1 << 16
    assert b"def " in data.tobytes() and b"import " in data.tobytes()
    src = make_source("stdlib", 256, 0, 1 << 16, B, 32)
    inputs, targets = src.sequence(0, 0, 32)
    assert torch.equal(inputs[1:], targets[:-1])  # next-token targets
    assert int(inputs.max()) < 256


def test_synthetic_padding_and_token_count():
    src = Synthetic(vocab=64, seed=0)
    mb = loader(src).batch(0)[0]
    real = mb.targets != IGNORE
    assert mb.tokens == int(real.sum())
    assert B * S // 2 <= mb.tokens < B * S  # ragged ends
    assert int(mb.inputs.max()) < 64 and int(mb.targets[real].min()) >= 0


@pytest.mark.parametrize(
    "suffix,dtype", [(".u16", np.uint16), (".u32", np.uint32), (".bin", np.uint16)]
)
def test_token_file_is_memory_mapped(tmp_path, suffix, dtype):
    tokens = (np.arange(1000) * 7 % 1000).astype(dtype)
    path = tmp_path / f"corpus{suffix}"
    tokens.tofile(path)
    loaded = load_path(str(path), max_bytes=1 << 20)
    assert isinstance(loaded, np.memmap)
    assert np.array_equal(loaded, tokens)
    src = make_source(str(path), 1000, 0, 1 << 20, B, 20)
    inputs, targets = src.sequence(3, 1, 20)
    start = int(np.flatnonzero(tokens == int(inputs[0]))[0])
    assert inputs.tolist() == tokens[start : start + 20].tolist()
    assert targets.tolist() == tokens[start + 1 : start + 21].tolist()


@pytest.mark.parametrize("suffix,size", [(".u16", 2001), (".u32", 4002), (".u16", 0)])
def test_ragged_token_file_is_an_error_naming_it(tmp_path, suffix, size):
    path = tmp_path / f"ragged{suffix}"
    path.write_bytes(bytes(size))
    item = 4 if suffix == ".u32" else 2
    want = rf"token file .*ragged\{suffix} is {size} bytes, not a positive multiple of {item}"
    with pytest.raises(ValueError, match=want):
        load_path(str(path), max_bytes=1 << 20)
    with pytest.raises(ValueError, match=want):  # before the sidecar check, or numpy's error
        make_source(str(path), 1000, 0, 1 << 20, B, 20)


def test_text_file_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 20)
    (tmp_path / "b.txt").write_text("second file\n" * 20)
    one = load_path(str(tmp_path / "a.txt"), max_bytes=1 << 20)
    assert one.dtype == np.uint8 and one.tobytes() == b"hello world\n" * 20
    both = load_path(str(tmp_path), max_bytes=1 << 20)
    assert both.tobytes() == b"hello world\n" * 20 + b"second file\n" * 20
    assert len(load_path(str(tmp_path), max_bytes=100)) == 100
    src = make_source(str(tmp_path), 256, 0, 1 << 20, B, 16)
    inputs, _ = src.sequence(0, 0, 16)
    assert bytes(inputs.tolist()) in both.tobytes()


def test_token_id_beyond_vocab_is_an_error(tmp_path):
    path = tmp_path / "big.u16"
    np.array([1, 2, 300, 4] * 50, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match=r"token id 300 .* >= model\.vocab=256"):
        make_source(str(path), 256, 0, 1 << 20, B, S)


def test_corpus_shorter_than_a_sequence_is_an_error():
    with pytest.raises(ValueError, match=r"corpus of 10 tokens is too short for seq_len=16"):
        TokenStream(np.arange(10, dtype=np.uint16), vocab=16, seed=0, global_batch=B, seq_len=16)
