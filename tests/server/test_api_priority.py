"""Priority scheduling through a real server (Hypercorn on loopback, the tiny Llama): the
`priority` field and `x-priority` header on every generation route, their 400s in each
route's envelope, and preemption seen from outside: an urgent request gets in at once while
long low-priority streams run, and every preempted stream's text equals its run alone."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine, wait_for

ROWS = 4  # max_seqs of the priority server: 4 long streams fill it
LIMITS = dict(max_seqs=ROWS, scheduling_policy="priority")


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(**LIMITS), ServerConfig())) as url:
        yield url


def _bodies(priority, model):
    """(path, body, where the envelope keeps the message) for every generation route."""
    return [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "priority": priority}, ("error", "message")),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": priority}, ("error", "message")),
        ("/v1/messages", {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                          "priority": priority}, ("error", "message")),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "priority": priority}, ("error", "message")),
        ("/completion", {"prompt": "hi", "n_predict": 2, "priority": priority}, ("error", "message")),
    ]


@pytest.mark.parametrize("bad", ["high", 1.5, True, 2 ** 31, -(2 ** 31) - 1])
def test_a_bad_priority_is_a_400_in_each_routes_envelope(http, model, bad):
    for path, body, (outer, inner) in _bodies(bad, model):
        r = http.post(path, json=body)
        assert r.status_code == 400, f"{path}: priority {bad!r} must be refused, got {r.status_code}"
        message = r.json()[outer][inner]
        assert "priority" in message and "Error" not in message, f"{path}: {message}"
        if path == "/v1/messages":
            assert r.json()["type"] == "error", "Anthropic's envelope"


def test_the_x_priority_header_is_read_when_the_body_names_none_and_the_body_wins(http, model):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"x-priority": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-priority"
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"x-priority": "-3"})
    assert r.status_code == 200
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 2},
                  headers={"x-priority": "soon"})
    assert r.status_code == 200, "the body's priority wins; the header is not read"
    for path, body, _ in _bodies(-7, model):
        assert http.post(path, json=body).status_code == 200, f"{path} takes a valid priority"


def _stream(base_url, body, out, key, started):
    """Streams a completion; `out[key]` gets its text, `started` is set at its first token."""
    text = []
    with httpx.Client(base_url=base_url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    text.append(chunk["choices"][0]["text"])
                    started.set()
    out[key] = "".join(text)


def test_an_urgent_request_gets_in_at_once_and_every_preempted_reply_equals_its_run_alone(server, http):
    before = http.get("/admin/stats").json()["num_preemptions"]
    # Two urgent requests at once preempt the two least urgent streams: priority 12 (greedy)
    # and 11 (seeded), so the real model's recompute is checked for both kinds of draw.
    low = [{"prompt": f"story {i}:", "max_tokens": 1500, "ignore_eos": True, "priority": level, **sampling}
           for i, (level, sampling) in enumerate([(10, {"temperature": 0}), (10, {"temperature": 1.0, "seed": 5}),
                                                  (12, {"temperature": 0}), (11, {"temperature": 1.0, "seed": 7})])]
    texts, threads, started = {}, [], [threading.Event() for _ in low]
    for i, body in enumerate(low):
        threads.append(threading.Thread(target=_stream, args=(server, body, texts, i, started[i])))
        threads[-1].start()
        assert started[i].wait(60), "each low-priority stream starts"
    urgent = {}

    def ask(k):
        with httpx.Client(base_url=server, timeout=120) as client:
            urgent[k] = client.post("/v1/completions", json={"prompt": f"now {k}:", "max_tokens": 8,
                                                             "ignore_eos": True, "temperature": 0, "priority": -5})

    askers = [threading.Thread(target=ask, args=(k,)) for k in range(2)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(120)
    assert [urgent[k].status_code for k in range(2)] == [200, 200]
    running_after = [t.is_alive() for t in threads]
    assert all(running_after), "the urgent replies came while every long stream was still open"
    for t in threads:
        t.join(180)
    stats = http.get("/admin/stats").json()
    assert stats["num_preemptions"] - before == 2, "one stream gave way for each urgent request"
    assert stats["recompiles_after_warmup"] == 0, "recomputing and pausing rows use the warmed shapes"
    metrics = http.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:num_preemptions_total{"))
    assert float(line.rsplit(" ", 1)[1]) >= stats["num_preemptions"]
    for i, body in enumerate(low):  # each alone: nothing else runs, nothing is preempted
        alone = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert texts[i] == alone, f"stream {i}: a preempted reply must equal its run alone, streamed once"
    wait_for(lambda: http.get("/admin/stats").json()["running_rows"] == 0)


def test_fcfs_server_refuses_a_nonzero_priority_and_takes_zero():
    with ServerThread(create_app(tiny_engine(max_seqs=ROWS), ServerConfig())) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2, "priority": 1})
            assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"]
            r = client.post("/completion", json={"prompt": "hi", "n_predict": 2}, headers={"x-priority": "4"})
            assert r.status_code == 400 and r.json()["error"]["code"] == 400, "llama.cpp's envelope"
            assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                        "priority": 0}).status_code == 200
            assert client.get("/admin/stats").json()["num_preemptions"] == 0
