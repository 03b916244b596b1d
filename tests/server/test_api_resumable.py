"""Resumable streams (`stream_resumable`): numbered events, a disconnect that does not
cancel, a resumed stream whose text equals an uninterrupted one, JSON polling, and the
bounded replay window (410 / 400 / 404). Real server, tiny Llama."""

from __future__ import annotations

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from api.state import state_of
from tests.support.server_harness import ServerThread, tiny_engine, wait_for

CHAT = {"messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 30, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_resumable": True}


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def sse_events(text: str) -> list[dict]:
    """Each SSE event as its fields ({"id", "retry", "data"}); comments dropped."""
    events = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if line and not line.startswith(":"))
        if fields:
            events.append(fields)
    return events


def deltas(events: list[dict]) -> str:
    out = []
    for e in events:
        if e["data"] != "[DONE]":
            chunk = httpx.Response(200, content=e["data"]).json()
            out.extend(c["delta"].get("content") or "" for c in chunk["choices"])
    return "".join(out)


def test_every_event_is_numbered_and_the_first_sets_retry(http):
    r = http.post("/v1/chat/completions", json=CHAT)
    events = sse_events(r.text)
    rid = r.headers["x-request-id"]
    assert [e["id"] for e in events] == [f"{rid}:{n}" for n in range(len(events))]
    assert events[0]["retry"] == "1000" and all("retry" not in e for e in events[1:])
    assert events[-1]["data"] == "[DONE]"


def test_a_resumed_stream_equals_an_uninterrupted_one(http, server):
    whole = deltas(sse_events(http.post("/v1/chat/completions", json=CHAT).text))
    before = http.get("/admin/stats").json()["aborted"]
    with httpx.Client(base_url=server, timeout=60) as first:
        with first.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            rid = r.headers["x-request-id"]
            seen, block = [], []
            for line in r.iter_lines():  # read 3 events, then drop the connection
                if line:
                    block.append(line)
                elif block:
                    seen.append(dict(f.split(": ", 1) for f in block))
                    block = []
                    if len(seen) == 3:
                        break
    resumed = http.get(f"/v1/stream/{rid}", headers={"Last-Event-ID": seen[-1]["id"]})
    assert resumed.status_code == 200
    rest = sse_events(resumed.text)
    assert rest[0]["id"] == f"{rid}:3" and rest[0]["retry"] == "1000"
    assert deltas(seen + rest) == whole, "replay + live equals the uninterrupted text"
    assert http.get("/admin/stats").json()["aborted"] == before, "the disconnect cancelled nothing"
    wait_for(lambda: http.get("/admin/stats").json()["recent"][-1]["id"] == rid)
    assert http.get("/admin/stats").json()["recent"][-1]["status"] == 200


def test_poll_returns_json_batches(http):
    rid = http.post("/v1/chat/completions", json=CHAT).headers["x-request-id"]
    batch = http.get(f"/v1/stream/{rid}/poll", params={"last_event_id": f"{rid}:1"}).json()
    assert batch["request_id"] == rid and batch["finished"] is True
    assert batch["events"][0]["id"] == f"{rid}:2" and batch["events"][-1]["data"] == "[DONE]"
    assert batch["last_event_id"] == batch["events"][-1]["id"]
    assert batch["events"][0]["data"]["object"] == "chat.completion.chunk"
    empty = http.get(f"/v1/stream/{rid}/poll", headers={"Last-Event-ID": batch["last_event_id"]}).json()
    assert empty["events"] == [] and empty["finished"] is True


def test_completions_resume_from_the_start_without_last_event_id(http):
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_resumable": True}
    r = http.post("/v1/completions", json=body)
    again = http.get(f"/v1/stream/{r.headers['x-request-id']}")
    assert again.text == r.text, "a replay from the start is the same bytes"


def test_bad_ids_and_unknown_streams(http):
    rid = http.post("/v1/chat/completions", json=CHAT).headers["x-request-id"]
    for value in ("nonsense", f"{rid}:x", "other:1", f"{rid}:999"):
        r = http.get(f"/v1/stream/{rid}", headers={"Last-Event-ID": value})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_last_event_id", value
    r = http.get("/v1/stream/chatcmpl-unknown")
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
    r = http.post("/v1/chat/completions", json={**CHAT, "stream": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_resumable"


def test_the_replay_window_is_bounded_in_bytes_age_and_number():
    config = ServerConfig(resumable_max_bytes=2000, resumable_ttl_s=60.0, resumable_max_streams=2)
    app = create_app(tiny_engine(), config)
    streams = state_of(app).resumable
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        first = http.post("/v1/chat/completions", json=CHAT)
        rid, last = first.headers["x-request-id"], sse_events(first.text)[-1]["id"]
        for lost in ({"Last-Event-ID": f"{rid}:0"}, {}):
            r = http.get(f"/v1/stream/{rid}", headers=lost)
            assert r.status_code == 410 and r.json()["error"]["code"] == "replay_window_lost", "early events dropped"
        n = int(last.rsplit(":", 1)[1])
        kept = sse_events(http.get(f"/v1/stream/{rid}", headers={"Last-Event-ID": f"{rid}:{n - 2}"}).text)
        assert [e["id"] for e in kept] == [f"{rid}:{n - 1}", last], "the newest events are kept"
        streams.streams[rid].finished_at -= config.resumable_ttl_s + 1  # aged past the TTL, not slept
        assert http.get(f"/v1/stream/{rid}").json()["error"]["code"] == "replay_window_lost"
        lasts = [sse_events(http.post("/v1/chat/completions", json=CHAT).text)[-1]["id"] for _ in range(3)]
        polls = [http.get(f"/v1/stream/{last.rsplit(':', 1)[0]}/poll", params={"last_event_id": last})
                 for last in lasts]
        assert [p.status_code for p in polls] == [410, 200, 200], "the oldest made room for the third"


def test_the_requests_own_connection_keeps_what_it_has_not_taken_past_the_byte_bound():
    import asyncio

    from api.resumable import ReplayBuffer

    async def run() -> None:
        buffer = ReplayBuffer("r", max_bytes=100)
        buffer.pin(0)  # the request's own connection, before it reads anything
        for _ in range(10):  # a burst of 400 bytes, as a busy loop hands the pump
            buffer.append(b"x" * 40)
        assert [n for n, _ in buffer.events] == list(range(10)), "nothing the connection has not taken is dropped"
        buffer.pin(6)  # it took 0..5
        assert [n for n, _ in buffer.events] == [6, 7, 8, 9]
        buffer.pin(None)  # it left: back to the byte bound
        assert [n for n, _ in buffer.events] == [8, 9] and buffer.num_bytes == 80

    asyncio.run(run())
