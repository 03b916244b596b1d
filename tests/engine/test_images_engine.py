"""Images through the engine: a tiny random Gemma 3 vision-language checkpoint (transformers 5.25)
served by the real engine, against HF's whole model given the same pixels.

- an image + text prompt: the prompt's logprobs (every position) within 1e-4 of HF's float32
  log-softmax, and the same 8 greedy tokens as HF's;
- two images in one prompt, and an image prompt batched with text-only rows, equal alone;
- the same image twice: one encoder run (the counter) and a prefix-cache hit; another image
  behind the same text: a new encoder run and no hit past the text;
- negative control: the image's placeholders one position off fail the comparison;
- a text model refuses a job with images.
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
from ferrox_jax.request import AdmissionError, Job, RowSampling  # noqa: E402
from tests.support.engine_helpers import float32_matmuls  # noqa: E402,F401

TOKENS = 16  # soft tokens per image
SIZE = 32  # pixels per side
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tests.support.tiny_vlm import make_tiny_vlm

    folder, vocab_size = make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-gemma3-vlm")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine.load(EngineConfig(model=str(folder), block_size=4, kv_blocks=300, max_context=256,
                                      prefill_chunk=32, max_seqs=8))
    engine.warmup()
    engine.start()
    yield folder, hf, engine, vocab_size
    engine.shutdown()


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (3, SIZE, SIZE)).astype(np.float32)


def _prompt(vocab_size: int, before: list[int], after: list[int], images: int = 1, gap: list[int] = ()):
    """Token ids with `images` placeholders (boi, TOKENS soft tokens, eoi) between text, and the
    soft tokens' start positions."""
    boi, eoi, img = vocab_size - 3, vocab_size - 2, vocab_size - 1
    ids, starts = list(before), []
    for i in range(images):
        if i:
            ids += list(gap)
        ids.append(boi)
        starts.append(len(ids))
        ids += [img] * TOKENS + [eoi]
    return ids + list(after), starts


def _spans(starts, seeds):
    out = []
    for start, seed in zip(starts, seeds):
        pixels = _pixels(seed)
        out.append(ImageSpan(start, TOKENS, hashlib.sha256(pixels.tobytes()).digest(), pixels))
    return tuple(out)


def _hf_logprobs(hf, ids, seeds, img_id) -> np.ndarray:
    with torch.no_grad():
        input_ids = torch.tensor([ids])
        kwargs = {}
        if seeds:
            kwargs = dict(pixel_values=torch.from_numpy(np.stack([_pixels(s) for s in seeds])),
                          token_type_ids=(input_ids == img_id).long())
        logits = hf(input_ids=input_ids, **kwargs).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def _hf_greedy(hf, ids, seeds, img_id, n) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        token = int(_hf_logprobs(hf, ids, seeds, img_id)[-1].argmax())
        out.append(token)
        ids.append(token)
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


def _run(engine, jobs):
    collectors = []
    for job in jobs:
        c = _Collect()
        engine.submit(job, c)
        collectors.append(c)
    return [(c.tokens(), c.events) for c in collectors]


def _job(name, ids, spans, n=8, **kw):
    return Job(name, tuple(ids), n, RowSampling(temperature=0.0), ignore_eos=True, images=spans, **kw)


def _prompt_error(events, ids, want) -> float:
    lps = events[0].prompt_logprobs  # (logprob of token p+1 given 0..p, top-k) for p = 0 ..
    got = np.array([lp for lp, _ in lps])
    ref = np.array([want[p, ids[p + 1]] for p in range(len(ids) - 1)])
    return float(np.abs(got - ref).max())


def test_image_prompt_matches_hf(vlm):
    _, hf, engine, vocab = vlm
    ids, starts = _prompt(vocab, list(range(10, 22)), list(range(40, 60)))
    spans = _spans(starts, [1])
    (tokens, events), = _run(engine, [_job("one", ids, spans, prompt_logprobs=True)])
    want = _hf_logprobs(hf, ids, [1], vocab - 1)
    assert _prompt_error(events, ids, want) < 1e-4
    assert tokens == _hf_greedy(hf, ids, [1], vocab - 1, 8)


def test_negative_control_placeholders_one_off_fail(vlm):
    _, hf, engine, vocab = vlm
    ids, starts = _prompt(vocab, list(range(10, 22)), list(range(40, 60)))
    shifted = _spans([starts[0] + 1], [1])  # the embeddings land one position late
    ids_shifted = ids[:starts[0]] + [30] + ids[starts[0]:starts[0] + TOKENS] + ids[starts[0] + TOKENS + 1:]
    (_, events), = _run(engine, [_job("off", ids_shifted, shifted, prompt_logprobs=True)])
    want = _hf_logprobs(hf, ids, [1], vocab - 1)
    assert _prompt_error(events, ids, want) > 1e-2


def test_two_images_and_batched_with_text_equal_alone(vlm):
    _, hf, engine, vocab = vlm
    ids, starts = _prompt(vocab, list(range(10, 15)), list(range(40, 50)), images=2, gap=[70, 71, 72])
    spans = _spans(starts, [2, 3])
    alone = _run(engine, [_job("two", ids, spans)])[0][0]
    assert alone == _hf_greedy(hf, ids, [2, 3], vocab - 1, 8)
    texts = [_job(f"text{i}", list(range(5 + i, 60 + 3 * i)), ()) for i in range(3)]
    text_alone = [_run(engine, [t])[0][0] for t in texts]
    together = _run(engine, [texts[0], _job("two-b", ids, spans), texts[1], texts[2]])
    assert together[1][0] == alone
    assert [together[i][0] for i in (0, 2, 3)] == text_alone


def test_same_image_hits_caches_and_another_misses(vlm):
    _, _, engine, vocab = vlm
    ids, starts = _prompt(vocab, list(range(100, 112)), list(range(120, 140)))
    before = engine.stats()
    first = _run(engine, [_job("c1", ids, _spans(starts, [7]))])[0]
    mid = engine.stats()
    second = _run(engine, [_job("c2", ids, _spans(starts, [7]))])[0]
    after = engine.stats()
    assert first[0] == second[0]
    assert mid.encoder_runs - before.encoder_runs == 1
    assert after.encoder_runs == mid.encoder_runs, "the same image was encoded again"
    assert second[1][0].num_cached_tokens >= starts[0] + TOKENS - 4, "the prompt's image blocks did not hit"
    other = _run(engine, [_job("c3", ids, _spans(starts, [8]))])[0]
    assert engine.stats().encoder_runs == after.encoder_runs + 1
    assert other[1][0].num_cached_tokens <= starts[0], "another image behind the same text hit the first's blocks"
    assert other[0] != first[0]


def test_text_model_refuses_images(tiny_llama):
    engine = Engine.load(EngineConfig(model=str(tiny_llama), block_size=8, kv_blocks=64, max_context=128))
    with pytest.raises(AdmissionError, match="takes no images"):
        engine.submit(_job("x", list(range(40)), _spans([5], [1])), lambda e: None)


def test_offline_llm_multi_modal_data_equals_the_engine_job(vlm):
    """`LLM.generate({"prompt": ..., "multi_modal_data": {"image": ...}})` (vLLM's shape): the marker in
    the text expanded as the processor does; the same greedy tokens as HF given the same pixels."""
    from PIL import Image

    from ferrox_jax.llm import LLM, SamplingParams
    from ferrox_jax.images import preprocess
    from models.image_input import ImageLimits

    folder, hf, engine, vocab = vlm
    rng = np.random.default_rng(11)
    picture = Image.fromarray(rng.integers(0, 256, (30, 44, 3)).astype(np.uint8), "RGB")
    prompt = "Look:<start_of_image>What is it?"
    with LLM(str(folder), block_size=4, kv_blocks=200, max_context=256, prefill_chunk=32, max_seqs=4) as llm:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": picture}},
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
        ids = out.prompt_token_ids
    assert ids.count(vocab - 1) == TOKENS and ids.count(vocab - 3) == 1
    (pixels, _), = preprocess([_png_bytes(picture)], SIZE, ImageLimits())
    want = []
    with torch.no_grad():
        for _ in range(6):
            input_ids = torch.tensor([ids + want])
            logits = hf(input_ids=input_ids, pixel_values=torch.from_numpy(pixels[None]),
                        token_type_ids=(input_ids == vocab - 1).long()).logits
            want.append(int(logits[0, -1].argmax()))
    assert out.outputs[0].token_ids == want


def _png_bytes(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
