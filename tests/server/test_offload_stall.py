"""The two GIL holders behind the /health stall under big count_tokens bodies (issue 26).

Measured (tools/bench/health_stall.py, docs/operations.md): the tokenizer backend's `encode`
held the GIL for the whole of a 2.4 M-character text, and full garbage collections
walked the whole model heap. Here: the GIL-free path gives the same ids, and
`freeze_heap` freezes (or, with --no-gc-freeze, does not). Timings are the tool's job.
"""

from __future__ import annotations

import gc

from api import offload
from models.tokenizer import GIL_FREE_ENCODE_CHARS, Tokenizer
from tests.support.server_harness import api_checkpoint


def test_a_long_text_encodes_to_the_same_ids_on_the_gil_free_path():
    tokenizer = Tokenizer.from_hf_dir(api_checkpoint())
    turn = "<|im_start|>user\nhello there, seven wizards<|im_end|>\n"
    text = turn * (GIL_FREE_ENCODE_CHARS // len(turn) + 10)
    assert len(text) > GIL_FREE_ENCODE_CHARS
    for special in (True, False):
        expected = tokenizer.backend.encode(text, add_special_tokens=special).ids
        assert tokenizer.encode(text, add_special_tokens=special) == expected
    assert tokenizer.encode("short", add_special_tokens=True) == tokenizer.backend.encode("short").ids


def test_freeze_heap_freezes_what_survives_and_can_be_turned_off():
    try:
        assert offload.freeze_heap() > 0
        assert gc.get_freeze_count() > 0
        gc.unfreeze()
        offload.configure(gc_freeze=False)  # --no-gc-freeze
        assert offload.freeze_heap() == 0 and gc.get_freeze_count() == 0
    finally:
        offload.configure()
        gc.unfreeze()
