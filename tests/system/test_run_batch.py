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
from tests.support.server_harness import DEFAULT_LIMITS, ServerThread, api_checkpoint, tiny_engine

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


# -- the files: checked before anything loads --------------------------------------------------


@pytest.fixture
def never_load(monkeypatch):
    """`cli.load_engine` replaced by a recorder that refuses: a command that must stop before
    loading the model leaves it empty."""
    calls = []

    def load(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("the model was loaded although the command should have stopped first")

    monkeypatch.setattr(cli, "load_engine", load)
    return calls


def run_batch_cli(capsys, input_path, output_path) -> tuple[int, str]:
    """`ferrox run-batch -i INPUT -o OUTPUT` on the tiny checkpoint: (exit status, stderr)."""
    model = str(api_checkpoint())
    capsys.readouterr()  # making the checkpoint (once) writes a progress bar
    status = cli.main(["run-batch", "-i", str(input_path), "-o", str(output_path), "--model", model,
                       "--log-level", "warning", "--no-progress"])
    return status, capsys.readouterr().err


def one_line(text: str) -> bool:
    return text.count("\n") == 1 and text.endswith("\n")


def test_a_missing_input_file_stops_with_one_line(tmp_path, capsys, never_load):
    status, err = run_batch_cli(capsys, tmp_path / "nope.jsonl", tmp_path / "out.jsonl")
    assert status == cli.EXIT_BAD_FILES == 2 and "no input file" in err and one_line(err), err
    assert not never_load, "nothing loads for a command that cannot run"


@pytest.mark.parametrize("spelling", ["the same path", "a symlink", "a hard link", "another spelling"])
def test_an_output_naming_the_input_is_refused_before_anything_loads(tmp_path, capsys, never_load, spelling):
    """`-i f -o f` used to truncate f to 0 bytes (the output was opened for writing before the
    input was read) and exit 0."""
    requests = tmp_path / "requests.jsonl"
    text = json.dumps(completion_line(1)) + "\n"
    requests.write_text(text)
    (tmp_path / "sub").mkdir()
    output = {"the same path": requests, "a symlink": tmp_path / "link.jsonl", "a hard link": tmp_path / "hard.jsonl",
              "another spelling": tmp_path / "sub" / ".." / "." / "requests.jsonl"}[spelling]
    if spelling == "a symlink":
        output.symlink_to(requests)
    elif spelling == "a hard link":
        os.link(requests, output)
    status, err = run_batch_cli(capsys, requests, output)
    assert requests.read_text() == text, "the requests are untouched"
    assert status == 2 and "same file" in err and one_line(err), f"one line and exit 2, got {status}: {err!r}"
    assert not never_load, "refused before the model loads"


@pytest.mark.parametrize("where", ["in a missing folder", "a folder"])
def test_an_unwritable_output_is_refused_before_the_model_loads(tmp_path, capsys, never_load, where):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps(completion_line(1)) + "\n")
    output = tmp_path / "missing" / "out.jsonl" if where == "in a missing folder" else tmp_path
    status, err = run_batch_cli(capsys, requests, output)
    assert status == 2 and str(output) in err and one_line(err), f"one line and exit 2, got {status}: {err!r}"
    assert not never_load, "an output that cannot be written is found before the model loads, not after"
    assert not (tmp_path / "missing").exists()


def test_checking_a_new_output_leaves_no_file_behind(tmp_path):
    from api.batch import check_files

    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n")
    assert check_files(str(requests), str(tmp_path / "new.jsonl")) is None
    assert not (tmp_path / "new.jsonl").exists(), "a failed load must not leave an empty results file"


# -- lines that cannot be read are answered in place ------------------------------------------

GOOD = json.dumps(completion_line(7)).encode()
LATIN1 = b'{"custom_id": "caf\xe9", "url": "/v1/completions", "body": {"prompt": "x"}}'  # é in Latin-1
UNREADABLE = {  # the line's bytes, and what its error must say
    "invalid UTF-8": (LATIN1, f"line 2 is not UTF-8 text (byte {LATIN1.index(0xE9) + 1} of the line)"),
    "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, "line 2 is nested too deeply"),
    "nested 100,000 deep in the body": (
        b'{"custom_id": "deep", "url": "/v1/completions", "body": {"prompt": ' + b"[" * 100_000 + b"]" * 100_000
        + b"}}", "line 2 is nested too deeply"),
    "a 5,000-digit number": (b'{"custom_id": "n", "url": "/v1/completions", "body": {"max_tokens": 1' + b"0" * 5000
                             + b"}}", "line 2 holds a number longer than"),
}


@pytest.mark.parametrize("kind", list(UNREADABLE))
def test_a_line_that_cannot_be_read_is_answered_and_the_run_goes_on(tmp_path, server, kind):
    """One undecodable line used to abort the whole run with a traceback."""
    import asyncio

    from api import batch

    raw, message = UNREADABLE[kind]
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    last = json.dumps(completion_line(8)).encode()
    requests.write_bytes(GOOD + b"\n" + raw + b"\n" + last + b"\n")
    app = create_app(tiny_engine(), ServerConfig())
    status = asyncio.run(batch.run_batch(app, str(requests), str(results), 2, progress=False))
    answers = [json.loads(line) for line in results.read_text().splitlines()]
    assert status == 0 and len(answers) == 3, "every line is answered"
    assert [a["custom_id"] for a in answers] == ["cmpl-7", None, "cmpl-8"]
    assert answers[1]["response"] is None and answers[1]["error"]["code"] == "invalid_batch_line"
    assert message in answers[1]["error"]["message"], answers[1]["error"]
    assert answers[0]["error"] is None and answers[2]["error"] is None, "the lines around it still run"


def test_a_custom_id_json_escapes_as_a_lone_surrogate_is_written_back(tmp_path, server):
    """JSON allows "\\ud800"; UTF-8 cannot encode it, which used to abort the run while
    writing that line's answer."""
    import asyncio

    from api import batch

    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    line = {**completion_line(9), "custom_id": "half \ud800 pair"}
    requests.write_text(json.dumps(line) + "\n" + json.dumps(completion_line(10)) + "\n")
    app = create_app(tiny_engine(), ServerConfig())
    assert asyncio.run(batch.run_batch(app, str(requests), str(results), 2, progress=False)) == 0
    answers = [json.loads(text) for text in results.read_text(encoding="utf-8").splitlines()]
    assert [a["custom_id"] for a in answers] == ["half \ud800 pair", "cmpl-10"]
    assert answers[0]["response"]["status_code"] == 200
