"""`ferrox run-batch -i requests.jsonl -o results.jsonl`: OpenAI's Batch file format, run offline.

The input is what OpenAI's Batch API and vLLM's `run_batch` read: one JSON object a line,

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

with `url` one of `SUPPORTED_URLS` and `body` that route's request. The output has one line
per input line, in input order, in OpenAI's batch output shape:

    {"id": "batch_req_…", "custom_id": "request-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-…", "body": {...}}, "error": null}

A line never aborts the run. A request the route refuses keeps the route's own answer
(`response.status_code` 4xx/5xx, `response.body` its error envelope) and names it in
`error` (`{"code", "message"}`); a line that is not a request at all (not UTF-8, not
JSON, nested too deeply to parse, no `custom_id`, another method or URL, `stream: true`,
a repeated `custom_id`) gets `response: null` and an `error` saying what is wrong with it.
The file is read as bytes and each line decoded on its own, so one bad line is one answer.

Each line is answered by the server's own route, in this process: the app is built as
`ferrox serve` builds it and every body goes through Quart's in-process client (no socket),
so validation, defaults, structured output, tools and the error envelopes are exactly the
server's. Up to `concurrency` lines run at once (twice the engine's rows by default, as
vLLM does), so the engine batches them continuously; a progress bar counts finished lines.

The two paths are checked before anything loads (`check_files`): a missing input, an
output that names the input itself (the same file, through a symlink, a hard link or
another spelling: opening it for writing would erase the requests before they are read)
and an output that cannot be created or written each stop the command with one line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import reprlib
import sys
import uuid
from typing import IO, Any, Callable, Iterable, Iterator

SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclasses.dataclass(frozen=True)
class BatchLine:
    """One input line: a request to run, or why it cannot be run."""

    index: int  # 0-based among the non-empty lines (the output line it answers)
    line_number: int  # 1-based in the file, for messages
    custom_id: str | None
    url: str | None = None
    payload: bytes | None = None  # the request body as JSON, serialized once while the line is checked
    problem: str | None = None  # set: the line is answered with this error, nothing runs


def parse_line(index: int, line_number: int, raw: bytes, seen: dict[str, int]) -> BatchLine:
    """Decode, parse and check one line (`seen`: custom_id -> line number, updated here).

    Whatever the bytes, the answer is a `BatchLine`: bytes that are not UTF-8, text that is
    not JSON, a number too long for Python to read and nesting deeper than its parser goes
    (json raises RecursionError, not a JSONDecodeError) each become the line's `problem`.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BatchLine(index, line_number, None, problem=f"line {line_number} is not UTF-8 text (byte {e.start + 1} "
                                                           "of the line); save the file as UTF-8")
    try:
        return _check_line(index, line_number, json.loads(text), seen)
    except json.JSONDecodeError as e:
        return BatchLine(index, line_number, None, problem=f"line {line_number} is not JSON: {e}")
    except ValueError:  # int() refuses digit strings past sys.get_int_max_str_digits()
        return BatchLine(index, line_number, None, problem=f"line {line_number} holds a number longer than "
                                                           f"{sys.get_int_max_str_digits()} digits; shorten it")
    except RecursionError:  # parsing, or serializing the body again, past Python's recursion limit
        return BatchLine(index, line_number, None, problem=f"line {line_number} is nested too deeply to read "
                                                           "(arrays or objects hundreds of levels deep); flatten it")


def _check_line(index: int, line_number: int, obj: Any, seen: dict[str, int]) -> BatchLine:
    if not isinstance(obj, dict):
        return BatchLine(index, line_number, None, problem=f"line {line_number} is not a JSON object")
    custom_id = obj.get("custom_id")

    def bad(message: str) -> BatchLine:
        return BatchLine(index, line_number, custom_id if isinstance(custom_id, str) else None,
                         problem=f"line {line_number}: {message}")

    if not isinstance(custom_id, str) or not custom_id:
        return bad("custom_id must be a non-empty string")
    if custom_id in seen:
        return bad(f"custom_id {custom_id!r} repeats line {seen[custom_id]}; each must be unique")
    seen[custom_id] = line_number
    # reprlib: a bounded depth and length, whatever a line puts in these fields
    if obj.get("method", "POST") != "POST":
        return bad(f"method must be POST; got {reprlib.repr(obj.get('method'))}")
    url = obj.get("url")
    if url not in SUPPORTED_URLS:
        return bad(f"url must be one of {', '.join(SUPPORTED_URLS)}; got {reprlib.repr(url)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("body must be a JSON object (the route's request)")
    if body.get("stream"):
        return bad("stream must not be true in a batch (each line gets one whole response)")
    return BatchLine(index, line_number, custom_id, url, json.dumps(body).encode())


def read_lines(lines: Iterable[bytes]) -> Iterator[BatchLine]:
    """The batch lines of an input file's lines, as bytes (blank lines skipped): each line
    is decoded on its own, so one that is not UTF-8 is answered in place."""
    seen: dict[str, int] = {}
    index = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        yield parse_line(index, number, raw, seen)
        index += 1


def _batch_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def line_error(line: BatchLine) -> dict:
    return {"id": _batch_id(), "custom_id": line.custom_id, "response": None,
            "error": {"code": "invalid_batch_line", "message": line.problem}}


def route_answer(line: BatchLine, status: int, body: Any, header_id: str | None) -> dict:
    """The output line for a route's answer (any status)."""
    request_id = (body.get("id") if isinstance(body, dict) else None) or header_id or _batch_id()
    error = None
    if status >= 400:
        envelope = body.get("error") if isinstance(body, dict) else None
        envelope = envelope if isinstance(envelope, dict) else {}
        error = {"code": envelope.get("code") or envelope.get("type") or str(status),
                 "message": envelope.get("message") or f"HTTP {status}"}
    return {"id": _batch_id(), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": error}


class OrderedWriter:
    """Writes answers in input order as they complete (later ones wait for earlier ones)."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.next_index = 0
        self.waiting: dict[int, dict] = {}
        self.num_errors = 0

    def add(self, index: int, answer: dict) -> None:
        self.num_errors += answer["error"] is not None
        self.waiting[index] = answer
        while self.next_index in self.waiting:
            self.out.write(_json_line(self.waiting.pop(self.next_index)))
            self.next_index += 1
        self.out.flush()


def _json_line(answer: dict) -> bytes:
    """One output line in UTF-8. A string holding a lone surrogate (JSON allows the escape
    "\\ud800", UTF-8 cannot encode it) is written \\u-escaped, as the input had it."""
    text = json.dumps(answer, ensure_ascii=False)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(answer) + "\n").encode("ascii")


async def run_lines(client: Any, lines: Iterable[BatchLine], writer: OrderedWriter, concurrency: int,
                    on_done: Callable[[], None] = lambda: None) -> None:
    """Answer every line through `client` (a Quart test client), at most `concurrency` at once."""
    slots = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()

    async def one(line: BatchLine) -> None:
        try:
            response = await client.post(line.url, data=line.payload, headers={"Content-Type": "application/json"})
            raw = await response.get_data()
            try:
                body = json.loads(raw)
            except ValueError:
                body = {"error": {"message": raw.decode("utf-8", "replace")[:500], "code": "invalid_response"}}
            writer.add(line.index, route_answer(line, response.status_code, body, response.headers.get("X-Request-Id")))
        finally:
            slots.release()
            on_done()

    for line in lines:
        if line.problem is not None:
            writer.add(line.index, line_error(line))
            on_done()
            continue
        await slots.acquire()
        task = asyncio.create_task(one(line))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


async def run_batch(app: Any, input_path: str, output_path: str, concurrency: int, progress: bool = True) -> int:
    """Serve `app` in-process, answer every line of `input_path` into `output_path`.

    Returns the exit status: 0 when every line was answered (errors included), 1 when the
    model failed to load (nothing is written then).
    """
    from tqdm import tqdm

    from api.state import state_of

    num_lines = _count_lines(input_path)
    async with app.test_app() as test_app:
        state = state_of(app)
        while state.health_state() == "loading" and not state.load_failed.is_set():
            await asyncio.sleep(0.05)
        if state.health_state() != "ready":
            print(f"ferrox run-batch: the model did not load: {state.load_error}", file=sys.stderr)
            return 1
        client = test_app.test_client()
        with _open(input_path, "rb") as src, _open(output_path, "wb") as dst, \
                tqdm(total=num_lines, desc="Running batch", unit="req", file=sys.stderr, disable=not progress) as bar:
            writer = OrderedWriter(dst)
            await run_lines(client, read_lines(src), writer, concurrency, on_done=lambda: bar.update(1))
        print(f"ferrox run-batch: {writer.next_index} lines answered, {writer.num_errors} with an error "
              f"-> {output_path}", file=sys.stderr)
    return 0


def check_files(input_path: str, output_path: str) -> str | None:
    """Why `-i input_path -o output_path` cannot run, or None; opens nothing for writing
    and leaves no file behind. `-` (stdin / stdout) is always usable."""
    if input_path != "-" and not os.path.isfile(input_path):
        return f"no input file {input_path!r}"
    if output_path == "-":
        return None
    if input_path != "-" and _same_file(input_path, output_path):
        return (f"-i and -o name the same file ({output_path!r}); writing the answers would erase the requests "
                "before they are read: give -o another file")
    return _unwritable(output_path)


def _same_file(a: str, b: str) -> bool:
    if os.path.exists(b):
        return os.path.samefile(a, b)  # symlinks, hard links, any spelling
    return os.path.realpath(a) == os.path.realpath(b)  # e.g. a dangling symlink that would land on it


def _unwritable(path: str) -> str | None:
    """Why `path` cannot take the answers, or None. A new file is created and removed again."""
    if os.path.isdir(path):
        return f"-o {path!r} is a folder; give a file path"
    try:
        if os.path.exists(path):
            with open(path, "a"):  # appending truncates nothing: the old answers stay until the run writes
                pass
        else:
            with open(path, "x"):
                pass
            os.unlink(path)
    except OSError as e:
        return f"cannot write -o {path!r}: {e.strerror}; give a path this user can write"
    return None


def _count_lines(path: str) -> int | None:
    if path == "-":
        return None
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _open(path: str, mode: str) -> Any:
    """`path` in binary `mode` ("rb" / "wb"); `-` is stdin's or stdout's byte stream."""
    if path == "-":
        import contextlib

        return contextlib.nullcontext(sys.stdin.buffer if mode == "rb" else sys.stdout.buffer)
    return open(path, mode)
