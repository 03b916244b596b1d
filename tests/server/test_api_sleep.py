"""`POST /sleep`, `POST /wake_up`, `GET /is_sleeping` over a real server: asleep, generation
is a 503 `sleeping` while `/health` and `/metrics` still answer; a stream in flight finishes
before the engine sleeps; waking (level 1: the KV cache; level 2: the weights too) gives
the same greedy text with nothing recompiled, and the prefix cache starts empty. Racing
transitions answer what happened and agree with `/is_sleeping` and `/health` afterwards: a
wake sent while a sleep waits for a stream wakes the engine once that sleep is done, two
sleeps both answer the level reached; a sleep during a model load and a load while asleep
are 409s; level 2 without the host memory for the weights is a 400 and nothing sleeps.
One app over the shared tiny engine, woken again whatever a test does."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from ferrox_jax import memory_bounds
from tests.support.server_harness import ServerThread, api_checkpoint, tiny_engine, wait_for

PROMPT = "Sleeping frees the key and value blocks of every layer; waking makes them again. "  # > 1 block
STREAM = {"prompt": "Hello", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
release_load = threading.Event()  # a model load this app starts waits for it, then fails (nothing loads)


def held_load(path: str):
    release_load.wait(60)
    raise RuntimeError("this test's factory loads nothing")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("models")
    (model_dir / "tiny-again").symlink_to(api_checkpoint(), target_is_directory=True)
    app = create_app(tiny_engine(), ServerConfig(model_dir=str(model_dir)), engine_factory=held_load)
    with ServerThread(app) as url:
        try:
            yield url
        finally:
            release_load.set()
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


def in_thread(answers: list, method: str, url: str) -> threading.Thread:
    thread = threading.Thread(target=lambda: answers.append(httpx.request(method, url, timeout=120)))
    thread.start()
    return thread


def test_a_wake_sent_while_a_sleep_waits_wakes_the_engine_once_that_sleep_is_done(server, http, model):
    slept: list[httpx.Response] = []
    woke: list[httpx.Response] = []
    with http.stream("POST", "/v1/completions", json={"model": model, **STREAM}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        sleeper = in_thread(slept, "POST", server + "/sleep")
        wait_for(lambda: http.get("/health").json()["state"] == "sleeping")  # sealed; the stream still runs
        waker = in_thread(woke, "POST", server + "/wake_up")
        rest = [line for line in lines if line.startswith("data: ")]
    sleeper.join(120)
    waker.join(120)
    assert rest[-1] == "data: [DONE]", "the stream in flight finished"
    assert slept[0].status_code == 200 and slept[0].json() == {"is_sleeping": True, "level": 1}, slept[0].text
    assert woke[0].status_code == 200 and woke[0].json() == {"is_sleeping": False}, woke[0].text
    assert http.get("/is_sleeping").json() == {"is_sleeping": False, "level": 0}, \
        "the wake came last: /is_sleeping agrees with its answer"
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2}).status_code == 200


def test_two_sleeps_at_once_both_answer_the_level_reached(server, http, model):
    answers: list[httpx.Response] = []
    with http.stream("POST", "/v1/completions", json={"model": model, **STREAM}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        sleepers = [in_thread(answers, "POST", server + "/sleep") for _ in range(2)]
        wait_for(lambda: http.get("/health").json()["state"] == "sleeping")
        list(lines)
    for sleeper in sleepers:
        sleeper.join(120)
    assert [(a.status_code, a.json()) for a in answers] == [(200, {"is_sleeping": True, "level": 1})] * 2, \
        "the second sleep answers what the first reached instead of sleeping twice"
    assert http.get("/is_sleeping").json() == {"is_sleeping": True, "level": 1}
    assert http.get("/health").json()["state"] == "sleeping", "/health agrees with /is_sleeping"
    assert http.post("/wake_up").json() == {"is_sleeping": False}
    assert http.get("/health").status_code == 200


def test_a_sleep_during_a_model_load_and_a_load_while_asleep_are_409s(http):
    release_load.clear()
    started = http.post("/admin/models/load", json={"model": "tiny-again"})
    assert started.status_code == 202, started.text
    during = http.post("/sleep")
    release_load.set()
    wait_for(lambda: http.get(f"/admin/tasks/{started.json()['task_id']}").json()["status"] == "failed",
             timeout_s=60)
    assert during.status_code == 409 and during.json()["error"]["code"] == "load_in_progress", \
        f"a sleep during a load: the load's swap would bring an awake engine in under 'sleeping': {during.text}"
    assert http.post("/sleep").status_code == 200
    asleep = http.post("/admin/models/load", json={"model": "tiny-again"})
    assert asleep.status_code == 409 and asleep.json()["error"]["code"] == "sleeping", asleep.text
    assert http.post("/wake_up").json() == {"is_sleeping": False}


def test_level_2_without_host_memory_for_the_weights_is_a_400_and_nothing_sleeps(http, model, monkeypatch):
    monkeypatch.setattr(memory_bounds, "host_available_bytes", lambda: 1024)  # 1 KiB left: less than any weights
    r = http.post("/sleep?level=2")
    assert r.status_code == 400 and r.json()["error"]["param"] == "level", r.text
    assert r.json()["error"]["code"] == "insufficient_memory" and "level 1" in r.json()["error"]["message"]
    assert http.get("/is_sleeping").json()["is_sleeping"] is False
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2}).status_code == 200
