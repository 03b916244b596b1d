"""Shedding and budget refusals on a deliberately small engine: one row at a time
(max_seqs 1), one waiting job (max_queue 1), 128 usable KV blocks of 16 positions
(2048 tokens) under a 4096-token context ceiling, so "more blocks than the whole budget"
is reachable. Also: keep-alive comments on a stream that waits in the queue, and
cancelling a waiting job (by /v1/cancel and by disconnect). The reply-size limit is
checked on the shared tiny engine (64 prompts fit its queue) with the default settings."""

from __future__ import annotations

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, parse_sse, tiny_engine, wait_for

BLOCK_SIZE = 16
KV_BLOCKS = 128  # usable (2048 tokens): the 2000-token blocker fits, 3000 tokens do not
KEEPALIVE_S = 0.2
BLOCKER = {"prompt": "Hello world", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(kv_blocks=KV_BLOCKS, max_context=4096, max_seqs=1, max_queue=1)


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, ServerConfig(sse_keepalive_s=KEEPALIVE_S))) as url:
        yield url


def stats(http) -> dict:
    return http.get("/admin/stats").json()


def idle(http) -> bool:
    s = stats(http)
    return s["kv_blocks_free"] == s["kv_blocks_total"] and s["queue_depth"] == 0 and s["generating_now"] == 0


def first_data(lines) -> dict:
    import json

    line = next(line for line in lines if line.startswith("data: "))
    return json.loads(line[len("data: "):])


def test_more_blocks_than_the_budget_is_400(http, engine):
    body = {"prompt": "Hello", "max_tokens": 3000}
    before = stats(http)["kv_rejected_too_large"]
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "device_memory_budget_exceeded" and error["type"] == "invalid_request_error"
    prompt = http.post("/v1/tokenize", json={"prompt": "Hello"}).json()["count"]
    need = -(-(prompt + 3000) // BLOCK_SIZE)  # ceil((prompt + max_tokens) / block_size)
    total = stats(http)["kv_blocks_total"]  # the budget as the batcher counts it
    assert need > total
    assert f"{need} KV blocks" in error["message"] and f"{total} blocks" in error["message"]
    per_block = engine.sizing.bytes_per_block
    assert f"{need * per_block} bytes" in error["message"] and f"{total * per_block} bytes" in error["message"]
    assert stats(http)["kv_rejected_too_large"] == before + 1
    assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200


def test_n_above_max_seqs_is_refused(http):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "n": 2})
    assert r.status_code == 400 and "max_seqs" in r.json()["error"]["message"]


def test_full_queue_is_503_with_retry_after_then_recovers(http, server):
    wait_for(lambda: idle(http))
    before = stats(http)["queue_rejected"]
    with httpx.Client(base_url=server, timeout=60) as a, httpx.Client(base_url=server, timeout=60) as b:
        with a.stream("POST", "/v1/completions", json=BLOCKER) as running:
            # Keep the line iterator: dropping it closes the connection, which cancels the job.
            blocker_lines = running.iter_lines()
            blocker_id = first_data(blocker_lines)["id"]  # decoding: holds the one row
            with b.stream("POST", "/v1/completions", json={**BLOCKER, "max_tokens": 4}) as waiting:
                wait_for(lambda: stats(http)["queue_depth"] == 1)
                r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                error = r.json()["error"]
                assert error["code"] == "queue_full"
                assert "1 jobs waiting" in error["message"] and "cap 1" in error["message"]
                assert stats(http)["queue_rejected"] == before + 1
                # The waiting stream is idle: it gets keep-alive comments, then is cancelled.
                lines = waiting.iter_lines()
                assert next(lines) == ": keep-alive"
                waiting_id = waiting.headers["x-request-id"]
                assert http.post("/v1/cancel", json={"request_id": waiting_id}).json()["cancelled"] is True
                events = parse_sse("\n".join(lines) + "\n\n")
                assert events[-1] == "[DONE]"
                choices = [c for e in events[:-1] for c in e["choices"]]
                assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["cancelled"]
                assert "".join(c["text"] for c in choices) == "", "cancelled while waiting: no tokens"
            http.post("/v1/cancel", json={"request_id": blocker_id})
    wait_for(lambda: idle(http))
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_disconnect_while_waiting_cancels_the_job(http, server):
    wait_for(lambda: idle(http))
    before = stats(http)["aborted"]
    with httpx.Client(base_url=server, timeout=60) as a, httpx.Client(base_url=server, timeout=60) as b:
        with a.stream("POST", "/v1/completions", json=BLOCKER) as running:
            blocker_lines = running.iter_lines()
            blocker_id = first_data(blocker_lines)["id"]
            with b.stream("POST", "/v1/completions", json=BLOCKER):
                wait_for(lambda: stats(http)["queue_depth"] == 1)
            # the waiting stream's connection is closed here, before it ever ran
            wait_for(lambda: stats(http)["queue_depth"] == 0)
            wait_for(lambda: stats(http)["aborted"] == before + 1)
            http.post("/v1/cancel", json={"request_id": blocker_id})
    wait_for(lambda: stats(http)["aborted"] == before + 2)
    wait_for(lambda: idle(http))


# ---------------------------------------------------------------- reply size


@pytest.fixture(scope="module")
def roomy_server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def test_a_reply_over_the_entry_limit_is_a_400_before_generating(roomy_server):
    # 64 prompts x n 1 x max_tokens 800 x (1 + 20 logprobs) = 1,075,200 token entries,
    # over the default 1,048,576: a 2 KB body that would build a ~20 MiB reply.
    body = {"prompt": ["Hi"] * 64, "max_tokens": 800, "logprobs": 20, "ignore_eos": True}
    with httpx.Client(base_url=roomy_server, timeout=120) as http:
        before = stats(http)["tokens_generated"]
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, f"a reply of a million logprob entries must be refused up front ({r.status_code})"
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("max_tokens", "reply_too_large"), error
        assert "1,075,200 token entries" in error["message"] and "1,048,576" in error["message"], error["message"]
        assert stats(http)["tokens_generated"] == before, "refused before generating"
        small = http.post("/v1/completions", json={**body, "prompt": ["Hi"] * 2, "max_tokens": 3})
        assert small.status_code == 200 and len(small.json()["choices"]) == 2, "the server keeps serving"
