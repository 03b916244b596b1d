"""`ferrox run-batch`: a 200-line OpenAI Batch file with good and bad lines, through the
real command (`api.cli.main`, loading its own engine from the tiny checkpoint with the
shared engine's limits, so its warm-up reads the compile cache).

Good lines must carry what the server answers for the same body (greedy, so the answers
are the server's exactly); bad lines must be answered in place, in order, without
stopping the run.
"""

from __future__ import annotations

import json
import os

import pytest

from api import cli
from api.app import create_app
from api.config import ServerConfig
from tests.server_harness import DEFAULT_LIMITS, ServerThread, api_checkpoint, tiny_engine

NUM_LINES = 200


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def chat_line(i: int) -> dict:
    return {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4, "temperature": 0}}


def completion_line(i: int) -> dict:
    return {"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"count {i}", "max_tokens": 3, "temperature": 0}}


def embedding_line(i: int) -> dict:
    return {"custom_id": f"emb-{i}", "url": "/v1/embeddings", "method": "POST", "body": {"input": f"text {i}"}}


# Bad lines, each with what its answer must say: (line text, status or None, error code, text in the message).
BAD_LINES = [
    ("{not json", None, "invalid_batch_line", "is not JSON"),
    (json.dumps([1, 2]), None, "invalid_batch_line", "not a JSON object"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}), None,
     "invalid_batch_line", "custom_id must be"),
    (json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}}), None,
     "invalid_batch_line", "method must be POST"),
    (json.dumps({"custom_id": "url", "method": "POST", "url": "/v1/images", "body": {}}), None,
     "invalid_batch_line", "url must be one of"),
    (json.dumps({"custom_id": "stream", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": "x", "stream": True}}), None, "invalid_batch_line", "stream must not be true"),
    (json.dumps(chat_line(0)), None, "invalid_batch_line", "repeats line"),  # chat-0 is line 1
    (json.dumps({"custom_id": "model", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": "x", "model": "no-such-model"}}), 404, "model_not_found", "not found"),
    (json.dumps({"custom_id": "temp", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "x"}], "temperature": -3}}),
     400, None, "temperature"),
    (json.dumps({"custom_id": "nomsg", "method": "POST", "url": "/v1/chat/completions", "body": {}}), 400, None,
     "messages"),
    (json.dumps({"custom_id": "schema", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                          "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": 7}}}}),
     400, "invalid_value", "response_format.json_schema.schema"),
]


def batch_file(path) -> list[str | None]:
    """Writes the input (a blank line in the middle, which is skipped); returns each answer's
    expected custom_id (None where the line has none)."""
    lines, ids = [], []
    bad_at = {17 * (k + 1): bad for k, bad in enumerate(BAD_LINES)}  # spread through the file
    makers = (chat_line, completion_line, embedding_line)
    for i in range(NUM_LINES):
        if i in bad_at:
            text = bad_at[i][0]
            obj = json.loads(text) if text.startswith("{") and text != "{not json" else None
            ids.append(obj.get("custom_id") if isinstance(obj, dict) else None)
        else:
            line = makers[i % 3](i)
            text = json.dumps(line)
            ids.append(line["custom_id"])
        lines.append(text)
        if i == 100:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return ids


def test_run_batch_answers_every_line_in_order(tmp_path, server, http, capsys):
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    expected_ids = batch_file(requests)
    limits = [f"--{k.replace('_', '-')}={v}" for k, v in DEFAULT_LIMITS.items() if v is not None]
    status = cli.main(["run-batch", "-i", str(requests), "-o", str(results), "--model", str(api_checkpoint()),
                       "--dtype", "float32", "--compile-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"],
                       "--log-level", "warning", *limits])
    assert status == 0
    answers = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(answers) == NUM_LINES, "one answer per non-empty line"
    assert [a["custom_id"] for a in answers] == expected_ids, "answers keep the input order"
    assert len({a["id"] for a in answers}) == NUM_LINES

    bad = {17 * (k + 1): b for k, b in enumerate(BAD_LINES)}
    for i, answer in enumerate(answers):
        if i in bad:
            _, status_code, code, text = bad[i]
            assert answer["error"] is not None and text in answer["error"]["message"], (i, answer)
            if status_code is None:
                assert answer["response"] is None and answer["error"]["code"] == code
            else:
                assert answer["response"]["status_code"] == status_code
                assert answer["response"]["body"]["error"]["message"] == answer["error"]["message"]
                assert code is None or answer["error"]["code"] == code
            continue
        assert answer["error"] is None and answer["response"]["status_code"] == 200, (i, answer)
        body = answer["response"]["body"]
        request_id = answer["response"]["request_id"]
        assert request_id and request_id == body.get("id", request_id), "the route's own id (embeddings: its header's)"
    # Good lines answer what the server answers for the same body.
    for i in (0, 1, 2, 3, 4, 5):
        line = (chat_line, completion_line, embedding_line)[i % 3](i)
        direct = http.post(line["url"], json=line["body"]).json()
        ours = answers[i]["response"]["body"]
        if line["url"] == "/v1/embeddings":
            assert ours["data"][0]["embedding"] == pytest.approx(direct["data"][0]["embedding"], abs=1e-5)
        else:
            assert ours["choices"] == direct["choices"] and ours["usage"]["completion_tokens"] == \
                direct["usage"]["completion_tokens"]
    err = capsys.readouterr().err
    assert "Running batch" in err and f"{NUM_LINES}/{NUM_LINES}" in err
    assert f"{NUM_LINES} lines answered, {len(BAD_LINES)} with an error" in err


def test_a_missing_input_file_stops_with_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no input file"):
        cli.main(["run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl")])
