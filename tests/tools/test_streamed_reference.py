"""tools/parity/streamed_reference.py on a tiny Q8_0 llama GGUF: the float32 reference
streamed a layer at a time equals the whole float32 model's (`compare_logits.py --reference
float32`), logits within 1e-5 and the same greedy tokens when teacher-forced along them.

Negative controls: a layer given another layer's weights moves the logits far past the
bound; a continuation that leaves the reference's path after two tokens scores a greedy
match of exactly 2. The LM head is read in chunks smaller than the vocabulary (HEAD_ROWS
patched), so the chunking is part of what is checked.
"""

from __future__ import annotations

import json
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from models import reference as lr
from tests.support.gguf_from_hf import write_gguf
from tools.parity import compare_logits as cl
from tools.parity import streamed_reference as sr

GREEDY = 6
PROMPTS = ["--prompt", "The quick brown fox", "--prompt", "Hello world! How are you today? Fine."]
RUN = ["--block-size", "8", "--max-chunk-tokens", "16", "--greedy-tokens", str(GREEDY)]


def _q8_0(name: str, arr: np.ndarray):
    return (quantize(arr, Q.Q8_0), Q.Q8_0) if arr.ndim == 2 else None


@pytest.fixture(scope="module")
def files(tiny_checkpoints, tmp_path_factory):
    """The tiny 2-layer llama as a Q8_0 GGUF (embedding and head too) and its whole float32 reference."""
    d = tmp_path_factory.mktemp("streamed")
    gguf_path = write_gguf(tiny_checkpoints("llama"), d / "tiny-q8_0.gguf", "llama", quant=_q8_0)
    whole = d / "whole.npz"
    assert cl.main(["--model", str(gguf_path), "--reference", "float32", "--save-reference", str(whole),
                    "--save-only", *PROMPTS, *RUN]) == 0
    return dict(gguf=str(gguf_path), whole=whole, dir=d)


@pytest.fixture(autouse=True)
def small_head_chunks(monkeypatch):
    monkeypatch.setattr(sr, "HEAD_ROWS", 100)  # the vocabulary of 384 in 4 chunks, the last partial


def test_streamed_equals_the_whole_float32_model(files, capsys):
    out = files["dir"] / "streamed.npz"
    assert sr.main(["--model", files["gguf"], "--along", str(files["whole"]), str(out), "--block-size", "8"]) == 0
    whole, streamed = lr.load_reference(files["whole"]), lr.load_reference(out)
    assert len(streamed) == 2
    for w, s in zip(whole, streamed):
        assert s.token_ids == w.token_ids
        assert np.abs(s.logits - w.logits).max() < 1e-5
        # Along its own greedy continuation the reference's argmax is that continuation.
        assert s.greedy_ids == w.greedy_ids == s.along_ids and len(w.greedy_ids) == GREEDY
    (summary,) = json.loads(capsys.readouterr().out)["along"]
    assert summary["greedy_match"] == [GREEDY] * 2 and summary["continuation_top1"] == [1.0] * 2
    assert summary["parting_gap"] == [None, None]
    assert cl.main(["--reference-file", str(files["whole"]), "--ours-file", str(out), "--max-abs", "1e-5",
                    "--min-greedy-match", str(GREEDY)]) == 0


def test_a_layer_with_another_layers_weights_is_caught(files):
    sm = sr.StreamedModel(files["gguf"])
    whole = lr.load_reference(files["whole"])
    good = sr.stream_logits(sm, [whole[0].token_ids], block_size=8)[0]
    assert len(sm._steps) == 1, "a llama's layers share one structure: one compiled layer step"
    for name in [n for n in sm.tensors if n.startswith("layers.1.")]:
        sm.tensors[name] = sm.tensors[name.replace("layers.1.", "layers.0.", 1)]
    wrong = sr.stream_logits(sm, [whole[0].token_ids], block_size=8)[0]
    assert np.abs(good - whole[0].logits).max() < 1e-5
    assert np.abs(wrong - whole[0].logits).max() > 1e-2


def test_greedy_match_along_another_continuation_is_exact(files):
    """A continuation equal to the reference's for two tokens, then off its path: the
    reference parts from it at step 2, so its own greedy is known for three tokens and the
    engine that chose the continuation scores exactly 2."""
    whole = lr.load_reference(files["whole"])
    vocab = whole[0].logits.shape[1]
    along = [lr.PromptReference(r.token_ids, r.text, logits=r.logits,
                                greedy_ids=[*r.greedy_ids[:2], (r.greedy_ids[2] + 1) % vocab, *r.greedy_ids[3:]])
             for r in whole]
    src, out = files["dir"] / "along.npz", files["dir"] / "ref-for-along.npz"
    lr.save_reference(src, along)
    (summary,) = sr.run_along(sr.StreamedModel(files["gguf"]), [(str(src), str(out))], block_size=8)
    assert summary.greedy_match == [2, 2] and summary.greedy_tokens == [GREEDY, GREEDY]
    assert all(g > 0 for g in summary.parting_gap)  # the reference's own choice ranks above the altered token
    for ref, a, w in zip(lr.load_reference(out), along, whole):
        assert lr.greedy_known_prefix(ref) == w.greedy_ids[:3]
        assert lr.compare_prompt(ref, w.logits, a.greedy_ids).greedy_match == 2
        # Read as a plain greedy list it would have credited a path the reference never took.
        assert lr.common_prefix_len(a.greedy_ids, ref.greedy_ids) == 2
        assert ref.greedy_ids[2] == w.greedy_ids[2] != a.greedy_ids[2]


def test_save_ours_writes_ferrox_side_for_the_along_pass(files):
    ours = files["dir"] / "ours.npz"
    assert cl.main(["--model", files["gguf"], "--save-ours", str(ours), *PROMPTS, *RUN]) == 0
    whole, mine = lr.load_reference(files["whole"]), lr.load_reference(ours)
    for w, m in zip(whole, mine):  # unquantized float32 here: ferrox's side is the whole reference
        assert m.token_ids == w.token_ids and m.greedy_ids == w.greedy_ids
        assert np.abs(m.logits - w.logits).max() < 1e-5
    with pytest.raises(SystemExit) as exc:  # a usage error: --save-ours runs without a reference
        cl.main(["--model", files["gguf"], "--save-ours", str(ours), "--reference", "float32"])
    assert exc.value.code == 2
