"""tools/bench/shape_gguf.py: random-weight GGUFs of real shapes in llama.cpp's layout, with
the default model's tokenizer, that ferrox loads (and llama-quantize quantizes, where built).

A tiny shape stands in for the real ones: the same writer, two layers of hidden 64."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from models import known_shapes
from models.loaders.gguf import config_from_gguf, default_model_path, load_gguf, open_gguf, open_gguf_checkpoint
from tools.bench import shape_gguf

REPO = Path(__file__).resolve().parents[2]
# A Llama 3.2-style tiny shape: tied head and the llama3 RoPE scaling (factor 32) the 1B and 3B carry.
TINY_32 = {**known_shapes.SHAPES["tiny"], "tie_word_embeddings": True, "rope_theta": 500000.0,
           "rope_scaling": known_shapes.SHAPES["llama-3.2-1b"]["rope_scaling"]}


@pytest.fixture(scope="module")
def source():
    """The default model's GGUF, opened once (parsing its vocabulary takes seconds)."""
    return open_gguf(default_model_path())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, source) -> Path:
    return shape_gguf.write_f16("tiny", tmp_path_factory.mktemp("gguf") / "tiny-F16.gguf", seed=3, tokenizer=source)


def test_the_file_has_the_shapes_numbers_and_the_default_models_vocabulary(tiny, source):
    cfg, _, tokenizer, _ = open_gguf_checkpoint(tiny)
    shape = known_shapes.SHAPES["tiny"]
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["num_attention_heads"],
        shape["num_key_value_heads"], shape["head_dim"])
    assert cfg.vocab_size == vocab == 49152, "SmolLM2's vocabulary, not the shape's own"
    assert not cfg.tie_word_embeddings and cfg.architecture == "LlamaForCausalLM"
    assert tokenizer.encode("Hello world") == [19556, 905], "SmolLM2's merges: 'Hello', ' world'"


def test_every_tensor_is_the_seeded_noise_the_plan_names(tiny):
    """What ferrox reads back is the generator's output rounded to f16, tensor for tensor; a
    file of another seed differs (the negative control: the check can fail)."""
    reader = open_gguf(tiny)
    cfg = dict(known_shapes.SHAPES["tiny"])
    written = {t.name: np.asarray(t.data) for t in reader.tensors}
    plan = shape_gguf.streamed_tensors(cfg, 49152, seed=3)
    assert [name for name, _ in plan] == list(written), "the converter's names, in its order"
    for name, t in plan:
        np.testing.assert_array_equal(written[name], t.array(), err_msg=name)
    weight = written["blk.0.ffn_up.weight"].astype(np.float32)
    assert written["blk.0.ffn_up.weight"].dtype == np.float16 and abs(weight.std() - shape_gguf.STD) < 1e-3
    assert written["blk.0.attn_norm.weight"].dtype == np.float32 and (written["blk.0.attn_norm.weight"] == 1).all()
    other = dict(shape_gguf.streamed_tensors(cfg, 49152, seed=4))["blk.0.ffn_up.weight"].array()
    assert not np.array_equal(written["blk.0.ffn_up.weight"], other), "another seed, other weights"


def test_the_same_seed_writes_the_same_bytes_in_chunks(tiny, source, tmp_path, monkeypatch):
    """Chunked generation (an 8B never lives in memory) is byte-identical to one chunk."""
    monkeypatch.setattr(shape_gguf, "CHUNK_VALUES", 1000)  # many chunks, one ends mid-row
    again = shape_gguf.write_f16("tiny", tmp_path / "again.gguf", seed=3, tokenizer=source)
    assert again.read_bytes() == tiny.read_bytes()


def test_llama32_rope_divisors_are_recognised_and_a_tied_head_has_no_output_tensor(source, tmp_path, monkeypatch):
    """The converter's rope_freqs formula, read by our loader as llama3 scaling with factor
    32 (the loader refuses divisors matching no known scaling, so a wrong formula fails)."""
    monkeypatch.setitem(known_shapes.SHAPES, "tiny-3.2", TINY_32)
    reader = open_gguf(shape_gguf.write_f16("tiny-3.2", tmp_path / "t.gguf", tokenizer=source))
    names = [t.name for t in reader.tensors]
    assert names[0] == "rope_freqs.weight" and "output.weight" not in names
    cfg = config_from_gguf(reader)
    assert cfg.tie_word_embeddings and cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 32.0
    assert shape_gguf.llama3_rope_divisors(known_shapes.SHAPES["tiny"]) is None


def test_a_qwen3_shape_carries_its_qk_norms(monkeypatch):
    cfg = {**known_shapes.SHAPES["tiny"], "architectures": ["Qwen3ForCausalLM"]}
    names = [name for name, _, _ in shape_gguf.tensor_plan(cfg, 100)]
    assert "blk.1.attn_q_norm.weight" in names and "blk.1.attn_k_norm.weight" in names
    assert len(names) == 1 + 2 * 11 + 1 + 1  # embedding, 11 per layer, output norm, untied head


def test_ferrox_loads_and_runs_it(tiny):
    """The model builds from the file and its logits are finite and differ by token."""
    import jax.numpy as jnp

    cfg, model, _ = load_gguf(tiny, dtype=jnp.float32)
    emb = np.asarray(model.embed.get_value())
    assert emb.shape == (49152, 64) and np.isfinite(emb).all()
    logits = np.asarray(model.logits(model.embed_tokens(jnp.asarray([1, 2]))))
    assert logits.shape == (2, 49152) and np.isfinite(logits).all() and not np.allclose(logits[0], logits[1])


def _quantizer() -> str | None:
    return shutil.which("llama-quantize") or next(
        (str(p) for p in (REPO / "results/llama-cpp/build/bin/llama-quantize",
                          Path("/work/peer/build/bin/llama-quantize")) if p.is_file()), None)


@pytest.mark.skipif(_quantizer() is None, reason="llama.cpp's llama-quantize is not built "
                    "(bench/llama_cpp/build_peer.sh)")
def test_llama_quantize_output_loads_in_ferrox(tiny, tmp_path):
    out = shape_gguf.quantize(_quantizer(), tiny, "Q4_0", tmp_path / "tiny-Q4_0.gguf", threads=1)
    types = {t.name: t.tensor_type.name for t in open_gguf(out).tensors}
    assert types["blk.0.ffn_up.weight"] == "Q4_0"
    cfg, _, _, int8 = open_gguf_checkpoint(out)
    assert cfg.num_layers == 2 and "layers.0.up_proj" in int8, "Q4_0 projections are read as blocks"
