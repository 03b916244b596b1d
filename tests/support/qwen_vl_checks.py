"""Helpers of the Qwen2.5-VL and Qwen3-VL image tests (tests/models/test_vision_qwen*.py): generated
images, the prompts, and jobs run through an engine with their prompt logprobs compared."""

from __future__ import annotations

import io
import threading

import numpy as np

from ferrox_jax.request import Job, RowSampling

TIMEOUT_S = 180
GREEDY = 6
PAD = "<|image_pad|>"
IMAGE = f"<|vision_start|>{PAD}<|vision_end|>"
PROMPT = f"<|im_start|>user\nLook {IMAGE} and say what it is<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\nFirst {IMAGE} then {IMAGE} which is brighter?<|im_end|>\n<|im_start|>assistant\n"


def serve_vlm(made, hf_class):
    """A module fixture's body: (folder, HF model, started engine, vocab) over the checkpoint
    `made` = (folder, vocab); the engine is shut down after the module."""
    import torch

    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine

    folder, vocab = made
    hf = hf_class.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine.load(EngineConfig(model=str(folder), block_size=4, kv_blocks=300, max_context=256,
                                      prefill_chunk=32, max_seqs=4))
    engine.warmup()
    engine.start()
    yield folder, hf, engine, vocab
    engine.shutdown()


def ours(engine, images, prompt=PROMPT):
    """(ids, spans) as the server lays the prompt and its images out."""
    from models.image_input import ImageLimits

    layout = engine.image_layout
    pictures = layout.preprocess([image_file(im) for im in images], ImageLimits())
    ids = engine.tokenizer.encode(layout.expand(prompt, engine.tokenizer, pictures), add_special_tokens=False)
    return ids, layout.spans(ids, pictures)


def image(seed: int, height: int, width: int):
    import PIL.Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3)).astype(np.uint8)  # blocky: JPEG keeps it
    return PIL.Image.fromarray(np.kron(base, np.ones((4, 4, 1), np.uint8))[:height, :width], "RGB")


def image_file(image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


class Collect:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if event.finish_reason:
            self.done.set()

    def tokens(self):
        assert self.done.wait(TIMEOUT_S)
        return [t for e in self.events for t in e.token_ids]


def submit_job(engine, name, ids, spans, n=GREEDY, **kw) -> Collect:
    c = Collect()
    engine.submit(Job(name, tuple(ids), n, RowSampling(temperature=0.0), ignore_eos=True, images=spans, **kw), c)
    return c


def run_job(engine, name, ids, spans, n=GREEDY, **kw):
    c = submit_job(engine, name, ids, spans, n, **kw)
    return c.tokens(), c.events


def prompt_logprobs(events) -> np.ndarray:
    return np.array([lp for lp, _ in events[0].prompt_logprobs])


def prompt_error(events, ids, want) -> float:
    ref = np.array([want[p, ids[p + 1]] for p in range(len(ids) - 1)])
    return float(np.abs(prompt_logprobs(events) - ref).max())
