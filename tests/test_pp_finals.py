"""Which compute action completes which parameters' gradients (pure: no processes)."""

from __future__ import annotations

from tetrad.models.llama_spec import LLAMA
from tetrad.parallel.pipeline.runtime import final_actions
from tetrad.parallel.pipeline.schedules import build_schedule
from tetrad.parallel.pipeline.stage import Chunk


def _names(layers: list[int], tied: bool) -> list[str]:
    names = ["tok_embeddings.weight", "norm.weight"] + ([] if tied else ["output.weight"])
    return names + [f"layers.{i}.{w}.weight" for i in layers for w in ("attention.wq", "ffn_norm")]


def test_zb_v_rank_0_completes_its_later_chunk_first_and_the_tied_embedding_last():
    """zb-v, pp 2, m 4: rank 0 holds stages 0 and 3 (layers 0 and 3). Stage 3's last W
    completes layer 3, the norm (and the head); stage 0's last W layer 0; the embedding,
    tied to the head, waits for the later of the two."""
    actions = build_schedule("zb-v", 2, 4, 2)[0]
    chunks = [Chunk(0, ("0",), True, False), Chunk(3, ("3",), False, True)]
    for tied in (False, True):
        finals = final_actions(actions, chunks, _names([0, 3], tied), LLAMA)
        ws = [(a.kind, a.stage, a.microbatch) for a in actions if a.kind == "W"]
        last3 = max(i for i, w in enumerate(ws) if w[1] == 3)
        last0 = max(i for i, w in enumerate(ws) if w[1] == 0)
        assert last3 < last0  # the later chunk's backward ends first on rank 0
        assert set(finals) == {ws[last3], ws[last0]}
        head = {"norm.weight"} | (set() if tied else {"output.weight"})
        layer3 = {"layers.3.attention.wq.weight", "layers.3.ffn_norm.weight"}
        assert finals[ws[last3]] == head | layer3
        layer0 = {"layers.0.attention.wq.weight", "layers.0.ffn_norm.weight"}
        assert finals[ws[last0]] == layer0 | {"tok_embeddings.weight"}


def test_1f1b_completes_everything_with_the_last_backward():
    actions = build_schedule("1f1b", 2, 3, 1)[1]
    chunks = [Chunk(1, ("1",), False, True)]
    names = ["norm.weight", "output.weight", "layers.1.attention.wq.weight"]
    assert final_actions(actions, chunks, names, LLAMA) == {("BW", 1, 2): frozenset(names)}
