"""Idefics3 / SmolVLM images through the engine: a tiny random `Idefics3ForConditionalGeneration`
(transformers 5.25, tests/support/tiny_smolvlm.py) served by the real engine, against HF's
processor and whole model given the same image.

- preprocessing, prompt layout and features without the engine: our tiles within 1e-6 of HF's PIL
  image processor for a wide image (2 x 2 tiles + the global view, or 1 x 2) and a one-tile image,
  our prompt ids equal to HF's processor's input_ids, the encoder + connector within 1e-5 of HF's
  `get_image_features` (negative control: a pixel shuffle without its transposes is far off);
- an image split into tiles, and an image that is not: the prompt's logprobs (every position)
  within 1e-4 of HF's float32 log-softmax, and the same greedy tokens;
- the same image twice: one encoder run per tile the first time, none the second, and a
  prefix-cache hit;
- negative controls: two tiles' embeddings swapped, or the image tokens attending both ways
  (Gemma 3's mask, where Idefics3's text model is causal), fail the comparison;
- a processor whose tiles are not the encoder's size is refused at load, naming both sizes.
"""

from __future__ import annotations

import dataclasses
import io
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from ferrox_jax.config import EngineConfig  # noqa: E402
from ferrox_jax.engine import Engine  # noqa: E402
from ferrox_jax.image_layout import TiledLayout  # noqa: E402
from ferrox_jax.request import Job, RowSampling  # noqa: E402
from models.image_input import ImageLimits  # noqa: E402
from tests.support.engine_helpers import float32_matmuls  # noqa: E402,F401
from tests.support.tiny_smolvlm import TILE, TOKENS_PER_TILE, processor  # noqa: E402

TIMEOUT_S = 180
GREEDY = 6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tests.support.tiny_smolvlm import make_tiny_smolvlm

    folder, vocab = make_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm") / "tiny-idefics3")
    hf = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine.load(EngineConfig(model=str(folder), block_size=4, kv_blocks=300, max_context=256,
                                      prefill_chunk=32, max_seqs=4))
    engine.warmup()
    engine.start()
    yield folder, hf, engine, vocab
    engine.shutdown()


def _image(seed: int, height: int, width: int):
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (height, width, 3)).astype(np.uint8), "RGB")


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


PROMPT = "<|im_start|>user\nLook <image> and say what it is<|im_end|>\n<|im_start|>assistant\n"


def _layout(engine, longest_edge: int | None = None) -> TiledLayout:
    cfg = engine.image_layout.cfg
    return TiledLayout(cfg if longest_edge is None else dataclasses.replace(cfg, longest_edge=longest_edge))


def _ours(engine, image, longest_edge=None):
    """(ids, spans, picture) as the server lays them out (`longest_edge` TILE: the unsplit layout)."""
    layout = _layout(engine, longest_edge)
    picture, = layout.preprocess([_png(image)], ImageLimits())
    ids = engine.tokenizer.encode(layout.expand(PROMPT, engine.tokenizer, [picture]), add_special_tokens=False)
    return ids, layout.spans(ids, [picture]), picture


def _reference(folder, image, longest_edge=None):
    """HF's processor's input_ids and pixel_values for PROMPT and `image`."""
    proc = processor(folder) if longest_edge is None else processor(folder, longest_edge)
    out = proc(text=[PROMPT], images=[[image]], return_tensors="pt")
    return out["input_ids"][0].tolist(), out["pixel_values"]


def _hf_logprobs(hf, ids, pixel_values) -> np.ndarray:
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids]), pixel_values=pixel_values).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def _hf_greedy(hf, ids, pixel_values, n=GREEDY) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(_hf_logprobs(hf, ids, pixel_values)[-1].argmax()))
        ids.append(out[-1])
    return out


class _Collect:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if event.finish_reason:
            self.done.set()

    def tokens(self):
        assert self.done.wait(TIMEOUT_S)
        return [t for e in self.events for t in e.token_ids]


def _run(engine, name, ids, spans, **kw):
    c = _Collect()
    engine.submit(Job(name, tuple(ids), GREEDY, RowSampling(temperature=0.0), ignore_eos=True, images=spans, **kw), c)
    return c.tokens(), c.events


def _prompt_error(events, ids, want) -> float:
    got = np.array([lp for lp, _ in events[0].prompt_logprobs])
    ref = np.array([want[p, ids[p + 1]] for p in range(len(ids) - 1)])
    return float(np.abs(got - ref).max())


@pytest.mark.parametrize("size,longest_edge,tiles", [((40, 70), None, 5), ((30, 90), None, 3), ((50, 44), TILE, 1)])
def test_pixels_layout_and_features_match_hf(vlm, size, longest_edge, tiles):
    from models.idefics3 import idefics3_image_tokens, pixel_shuffle, read_idefics3_vision

    folder, hf, engine, _ = vlm
    image = _image(3, *size)
    ids, spans, picture = _ours(engine, image, longest_edge)
    want_ids, want_pixels = _reference(folder, image, longest_edge)
    assert len(picture.tiles) == len(spans) == tiles
    assert np.abs(picture.tiles - want_pixels[0].numpy()).max() < 1e-6
    assert ids == want_ids
    ref = hf.get_image_features(want_pixels).pooler_output[0].detach().numpy()
    cfg, params = read_idefics3_vision(folder)
    ours = np.asarray(idefics3_image_tokens(params, picture.tiles, cfg)).reshape(ref.shape)
    assert np.abs(ours - ref).max() < 1e-5
    # Negative control: the shuffle's grid read without its transposes (tokens from the wrong patches).
    from models.siglip import encode

    h = encode(params, picture.tiles, cfg)
    b, p, d = h.shape
    wrong = np.asarray(h.reshape(b, p // 4, d * 4) @ params["connector"]).reshape(ref.shape)
    assert np.asarray(pixel_shuffle(h, 2)).shape == (b, p // 4, d * 4)
    assert np.abs(wrong - ref).max() > 1e-2


@pytest.mark.parametrize("size,longest_edge", [((40, 70), None), ((50, 44), TILE)], ids=["split", "one-tile"])
def test_image_prompt_matches_hf(vlm, size, longest_edge):
    folder, hf, engine, _ = vlm
    image = _image(5, *size)
    ids, spans, _ = _ours(engine, image, longest_edge)
    want_ids, pixels = _reference(folder, image, longest_edge)
    assert ids == want_ids
    tokens, events = _run(engine, f"p-{size}", ids, spans, prompt_logprobs=True)
    # The split prompt's chunks (32 tokens from its cached prefix on) end inside tiles: causal spans
    # are cut like text, and the parity below covers that.
    ends = range(events[0].num_cached_tokens + 32, len(ids), 32)
    assert longest_edge is not None or any(s.start < end < s.stop for s in spans for end in ends)
    assert _prompt_error(events, ids, _hf_logprobs(hf, ids, pixels)) < 1e-4
    assert tokens == _hf_greedy(hf, ids, pixels)


def test_negative_controls_swapped_tiles_and_bidirectional_fail(vlm):
    folder, hf, engine, _ = vlm
    image = _image(6, 40, 70)
    ids, spans, _ = _ours(engine, image)
    want = _hf_logprobs(hf, ids, _reference(folder, image)[1])
    a, b = spans[0], spans[1]
    swapped = (dataclasses.replace(a, digest=b.digest, pixels=b.pixels),
               dataclasses.replace(b, digest=a.digest, pixels=a.pixels)) + spans[2:]
    _, events = _run(engine, "swapped", ids, swapped, prompt_logprobs=True)
    assert _prompt_error(events, ids, want) > 1e-2
    both_ways = tuple(dataclasses.replace(s, bidirectional=True) for s in spans)
    _, events = _run(engine, "both-ways", ids, both_ways, prompt_logprobs=True)
    assert _prompt_error(events, ids, want) > 1e-2
    _, events = _run(engine, "control", ids, spans, prompt_logprobs=True)  # the same engine, the real spans
    assert _prompt_error(events, ids, want) < 1e-4


def test_same_image_twice_one_encoder_run_and_a_prefix_hit(vlm):
    _, _, engine, _ = vlm
    image = _image(9, 36, 64)
    ids, spans, picture = _ours(engine, image)
    before = engine.stats()
    first = _run(engine, "c1", ids, spans)
    mid = engine.stats()
    ids2, spans2, _ = _ours(engine, image)  # decoded and tiled again from the file's bytes
    second = _run(engine, "c2", ids2, spans2)
    after = engine.stats()
    assert first[0] == second[0]
    assert mid.encoder_runs - before.encoder_runs == len(picture.tiles)
    assert after.encoder_runs == mid.encoder_runs, "the same image was encoded again"
    assert second[1][0].num_cached_tokens >= spans[-1].stop - 4, "the image's blocks did not hit"


def test_tiles_of_another_size_are_refused_at_load(tmp_path):
    from models.config import UnsupportedModelError
    from models.idefics3 import config_from_hf
    from models.loaders.safetensors import read_config
    from tests.support.tiny_smolvlm import make_tiny_smolvlm

    folder, _ = make_tiny_smolvlm(tmp_path / "tiny-idefics3")
    cfg = read_config(folder)
    assert cfg.vision is not None and cfg.vision.tokens_per_image == TOKENS_PER_TILE
    import json

    raw = json.loads((folder / "config.json").read_text())
    assert config_from_hf(raw, {"max_image_size": {"longest_edge": TILE}}).vision.image_size == TILE
    with pytest.raises(UnsupportedModelError,
                       match="max_image_size 48 differs from the vision encoder's image_size 32"):
        config_from_hf(raw, {"max_image_size": {"longest_edge": 48}})
    processor_file = folder / "preprocessor_config.json"
    settings = json.loads(processor_file.read_text())
    processor_file.write_text(json.dumps({**settings, "max_image_size": {"longest_edge": 48}}))
    with pytest.raises(UnsupportedModelError, match="max_image_size 48"):
        Engine.load(EngineConfig(model=str(folder), block_size=4, kv_blocks=64, max_context=128))
