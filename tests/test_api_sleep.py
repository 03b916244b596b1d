"""`POST /sleep`, `POST /wake_up`, `GET /is_sleeping` over a real server: asleep, generation
is a 503 `sleeping` while `/health` and `/metrics` still answer; a stream in flight finishes
before the engine sleeps; waking (level 1: the KV cache; level 2: the weights too) gives
the same greedy text with nothing recompiled, and the prefix cache starts empty. One app
over the shared tiny engine, woken again whatever a test does."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.server_harness import ServerThread, tiny_engine

PROMPT = "Sleeping frees the key and value blocks of every layer; waking makes them again. "  # > 1 block


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        try:
            yield url
        finally:
            httpx.post(url + "/wake_up", timeout=60)


def greedy(http, model):
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                           "ignore_eos": True})
    return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("level", [1, 2])
def test_waking_gives_the_same_text_without_recompiling(http, client, model, level):
    text, _ = greedy(http, model)
    assert greedy(http, model)[1] > 0, "awake, the second prompt comes from the prefix cache"
    recompiles = http.get("/admin/stats").json()["recompiles_after_warmup"]
    asleep = http.post(f"/sleep?level={level}")
    assert asleep.status_code == 200 and asleep.json() == {"is_sleeping": True, "level": level}
    assert http.get("/is_sleeping").json()["is_sleeping"] is True
    health = http.get("/health")
    assert health.status_code == 503 and health.json()["state"] == "sleeping"
    assert http.get("/metrics").status_code == 200, "metrics answer without waking"
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model, prompt="Hello", max_tokens=1)
    assert e.value.status_code == 503 and e.value.body["code"] == "sleeping"
    assert http.post("/wake_up").json() == {"is_sleeping": False}
    assert http.get("/health").status_code == 200
    assert greedy(http, model) == (text, 0), "the same text; the prefix cache forgot what the sleep freed"
    assert http.get("/admin/stats").json()["recompiles_after_warmup"] == recompiles, "nothing recompiled"


def test_a_stream_in_flight_finishes_before_the_engine_sleeps(server, http, model):
    answers: list[httpx.Response] = []
    body = {"model": model, "prompt": "Hello", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        sleeper = threading.Thread(target=lambda: answers.append(httpx.post(server + "/sleep", timeout=60)))
        sleeper.start()
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    sleeper.join(60)
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert answers and answers[0].status_code == 200 and answers[0].json()["is_sleeping"] is True
    assert http.post("/wake_up").status_code == 200


def test_a_bad_level_is_a_400(http):
    r = http.post("/sleep?level=3")
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    assert http.get("/is_sleeping").json()["is_sleeping"] is False
