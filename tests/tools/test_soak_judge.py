"""The soak's prefix-cache re-check judge: identical outputs pass, a difference at a near
tie is counted apart, any other difference is a mismatch (tools/soak/soak_requests.py)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from tools.soak import soak_requests

VOCAB = {1: "a", 2: "b", 3: "c", 4: "d"}


def _server(cached: list[int], cold: list[int], top5: dict[str, float]):
    """A stand-in for the server's four routes the re-check reads."""
    calls = {"completion": 0}

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/completion":
            calls["completion"] += 1
            tokens = cold if body["cache_prompt"] is False else cached
            return httpx.Response(200, json={"content": "".join(VOCAB[t] for t in tokens), "tokens": tokens,
                                             "tokens_cached": 5 if body["cache_prompt"] else 0})
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [7, 8, 9]})
        if request.url.path == "/v1/completions":
            assert body["prompt"] == [7, 8, 9, 1, 2], "the prompt, then the common part of the outputs"
            return httpx.Response(200, json={"choices": [{"logprobs": {"top_logprobs": [top5]}}]})
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": VOCAB[body["tokens"][0]]})
        return httpx.Response(404)

    return httpx.MockTransport(handle)


def _judge(cached, cold, top5):
    async def go():
        diffs: list[dict] = []
        async with httpx.AsyncClient(transport=_server(cached, cold, top5), base_url="http://soak") as client:
            outcome = await soak_requests.recheck(client, random.Random(0), "m", ["prefix"], diffs)
        return outcome, diffs

    return asyncio.run(go())


def test_identical_outputs_read_from_the_cache_pass():
    assert _judge([1, 2, 3], [1, 2, 3], {}) == ("200-cached", [])


def test_a_difference_between_two_near_equal_picks_is_a_near_tie():
    outcome, diffs = _judge([1, 2, 3, 1], [1, 2, 4, 4], {"c": -0.6935, "d": -0.6930, "a": -5.0})
    assert outcome == "recheck-near-tie"
    assert diffs[0]["position"] == 2 and diffs[0]["picks"] == ["c", "d"] and diffs[0]["gap_nats"] == 0.0005


def test_a_difference_where_one_pick_is_clearly_better_is_a_mismatch():
    outcome, diffs = _judge([1, 2, 3], [1, 2, 4], {"c": -0.1, "d": -2.4})
    assert outcome == "recheck-mismatch" and diffs[0]["gap_nats"] == 2.3


def test_a_difference_whose_picks_are_not_both_in_the_top_five_is_a_mismatch():
    outcome, diffs = _judge([1, 2, 3], [1, 2, 4], {"c": -0.1, "a": -2.4})
    assert outcome == "recheck-mismatch" and diffs[0]["gap_nats"] is None
