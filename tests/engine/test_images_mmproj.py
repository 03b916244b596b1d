"""Gemma 3 served from GGUF files with images: the text model as llama.cpp's converter writes it and
the vision tower + projector as its mmproj file (`--mmproj`), against the HF checkpoint they came from.

- the projector file's tensors read back as the HF folder's (names, layouts, the norm's 1 + w
  undone): exactly for F32 tensors, and F16 ones equal to the HF values rounded to float16;
- an image prompt through an engine on the two GGUFs equals HF's whole model given the same pixels
  (prompt logprobs within 1e-4, the same greedy tokens), and the same image twice hits;
- refusals: --mmproj beside a non-Gemma model, a projector file of another kind.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ferrox_jax.config import EngineConfig  # noqa: E402
from ferrox_jax.engine import Engine  # noqa: E402
from ferrox_jax.images import ImageSpan  # noqa: E402
from ferrox_jax.request import Job, RowSampling  # noqa: E402
from models import siglip  # noqa: E402
from models.config import UnsupportedModelError  # noqa: E402
from tests.support.engine_helpers import float32_matmuls  # noqa: E402,F401
from tests.support.gguf_from_hf import write_gemma3_mmproj, write_gemma3_text_gguf  # noqa: E402
from tests.support.tiny_vlm import IMAGE_SIZE, TOKENS_PER_IMAGE, make_tiny_vlm  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmproj")
    folder, vocab = make_tiny_vlm(root / "tiny-gemma3-vlm")
    text = write_gemma3_text_gguf(folder, root / "tiny-gemma3.gguf")
    mmproj_f32 = write_gemma3_mmproj(folder, root / "mmproj-f32.gguf", f16=False)
    mmproj_f16 = write_gemma3_mmproj(folder, root / "mmproj-f16.gguf")
    return folder, vocab, text, mmproj_f32, mmproj_f16


def test_projector_tensors_read_back_as_the_folders(files):
    folder, _, text, _, mmproj = files
    from models.tokenizer import Tokenizer

    cfg_hf, params_hf = siglip.read_gemma3_vision(folder)
    cfg, params = siglip.read_gemma3_mmproj(mmproj, Tokenizer.from_hf_dir(folder))
    assert cfg == cfg_hf
    for name, want in params_hf.items():
        want = np.asarray(want)
        got = np.asarray(params[name])
        stored_f16 = want.ndim == 2 and name not in ("position_embedding", "patch_embedding")
        expect = want.astype(np.float16).astype(np.float32) if stored_f16 else want
        if name == "mm_norm":  # stored as 1 + w in F32, read back minus 1
            np.testing.assert_allclose(got, want, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got, expect, err_msg=name)


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)


def test_gguf_engine_with_mmproj_equals_hf(files):
    folder, vocab, text, mmproj, _ = files
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine.load(EngineConfig(model=str(text), mmproj=str(mmproj), block_size=4, kv_blocks=200,
                                      max_context=256, prefill_chunk=32, max_seqs=4, dtype="float32",
                                      quantization="none"))
    assert engine.takes_images
    engine.warmup()
    engine.start()
    try:
        ids = list(range(10, 20)) + [vocab - 3] + [vocab - 1] * TOKENS_PER_IMAGE + [vocab - 2] + list(range(30, 45))
        pixels = _pixels(3)
        span = ImageSpan(11, TOKENS_PER_IMAGE, hashlib.sha256(pixels.tobytes()).digest(), pixels)
        results = []
        for name in ("a", "b"):
            events, done = [], threading.Event()

            def on_event(e, events=events, done=done):
                events.append(e)
                if e.finish_reason:
                    done.set()

            engine.submit(Job(name, tuple(ids), 6, RowSampling(temperature=0.0), ignore_eos=True,
                              prompt_logprobs=name == "a", images=(span,)), on_event)
            assert done.wait(180)
            results.append(events)
        with torch.no_grad():
            input_ids = torch.tensor([ids])
            logits = hf(input_ids=input_ids, pixel_values=torch.from_numpy(pixels[None]),
                        token_type_ids=(input_ids == vocab - 1).long()).logits[0].double()
        want = torch.log_softmax(logits, -1).numpy()
        got = np.array([lp for lp, _ in results[0][0].prompt_logprobs])
        assert np.abs(got - np.array([want[p, ids[p + 1]] for p in range(len(ids) - 1)])).max() < 1e-4
        tokens = [[t for e in events for t in e.token_ids] for events in results]
        assert tokens[0] == tokens[1]
        greedy = []
        with torch.no_grad():
            for _ in range(6):
                input_ids = torch.tensor([ids + greedy])
                out = hf(input_ids=input_ids, pixel_values=torch.from_numpy(pixels[None]),
                         token_type_ids=(input_ids == vocab - 1).long()).logits
                greedy.append(int(out[0, -1].argmax()))
        assert tokens[0] == greedy
        assert engine.stats().encoder_runs == 1, "the same image was encoded twice"
    finally:
        engine.shutdown()


def test_mmproj_beside_another_family_is_refused(files, tiny_llama):
    _, _, _, mmproj, _ = files
    with pytest.raises(ValueError, match="--mmproj is supported for Gemma 3"):
        Engine.load(EngineConfig(model=str(tiny_llama), mmproj=str(mmproj), kv_blocks=32, max_context=64))


def test_another_projector_kind_is_refused(files, tmp_path):
    import gguf

    folder = files[0]
    from models.tokenizer import Tokenizer

    w = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "clip")
    w.add_clip_projector_type("idefics3")
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="projector type 'idefics3'"):
        siglip.read_gemma3_mmproj(tmp_path / "other.gguf", Tokenizer.from_hf_dir(folder))
