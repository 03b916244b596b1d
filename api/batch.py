"""`ferrox run-batch -i requests.jsonl -o results.jsonl`: OpenAI's Batch file format, run offline.

The input is what OpenAI's Batch API and vLLM's `run_batch` read: one JSON object a line,

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

with `url` one of `SUPPORTED_URLS` and `body` that route's request. The output has one line
per input line, in input order, in OpenAI's batch output shape:

    {"id": "batch_req_…", "custom_id": "request-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-…", "body": {...}}, "error": null}

A line never aborts the run. A request the route refuses keeps the route's own answer
(`response.status_code` 4xx/5xx, `response.body` its error envelope) and names it in
`error` (`{"code", "message"}`); a line that is not a request at all (not JSON, no
`custom_id`, another method or URL, `stream: true`, a repeated `custom_id`) gets
`response: null` and an `error` saying what is wrong with it.

Each line is answered by the server's own route, in this process: the app is built as
`ferrox serve` builds it and every body goes through Quart's in-process client (no socket),
so validation, defaults, structured output, tools and the error envelopes are exactly the
server's. Up to `concurrency` lines run at once (twice the engine's rows by default, as
vLLM does), so the engine batches them continuously; a progress bar counts finished lines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
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
    body: dict | None = None
    problem: str | None = None  # set: the line is answered with this error, nothing runs


def parse_line(index: int, line_number: int, text: str, seen: dict[str, int]) -> BatchLine:
    """Parse and check one line (`seen`: custom_id -> line number, updated here)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(index, line_number, None, problem=f"line {line_number} is not JSON: {e}")
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
    if obj.get("method", "POST") != "POST":
        return bad(f"method must be POST; got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in SUPPORTED_URLS:
        return bad(f"url must be one of {', '.join(SUPPORTED_URLS)}; got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("body must be a JSON object (the route's request)")
    if body.get("stream"):
        return bad("stream must not be true in a batch (each line gets one whole response)")
    return BatchLine(index, line_number, custom_id, url, body)


def read_lines(lines: Iterable[str]) -> Iterator[BatchLine]:
    """The batch lines of an input file's text lines (blank lines skipped)."""
    seen: dict[str, int] = {}
    index = 0
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        yield parse_line(index, number, text, seen)
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

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.next_index = 0
        self.waiting: dict[int, dict] = {}
        self.num_errors = 0

    def add(self, index: int, answer: dict) -> None:
        self.num_errors += answer["error"] is not None
        self.waiting[index] = answer
        while self.next_index in self.waiting:
            self.out.write(json.dumps(self.waiting.pop(self.next_index), ensure_ascii=False) + "\n")
            self.next_index += 1
        self.out.flush()


async def run_lines(client: Any, lines: Iterable[BatchLine], writer: OrderedWriter, concurrency: int,
                    on_done: Callable[[], None] = lambda: None) -> None:
    """Answer every line through `client` (a Quart test client), at most `concurrency` at once."""
    slots = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()

    async def one(line: BatchLine) -> None:
        try:
            response = await client.post(line.url, json=line.body)
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
        with _open(input_path, "r") as src, _open(output_path, "w") as dst, \
                tqdm(total=num_lines, desc="Running batch", unit="req", file=sys.stderr, disable=not progress) as bar:
            writer = OrderedWriter(dst)
            await run_lines(client, read_lines(src), writer, concurrency, on_done=lambda: bar.update(1))
        print(f"ferrox run-batch: {writer.next_index} lines answered, {writer.num_errors} with an error "
              f"-> {output_path}", file=sys.stderr)
    return 0


def _count_lines(path: str) -> int | None:
    if path == "-":
        return None
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def _open(path: str, mode: str) -> Any:
    if path == "-":
        import contextlib

        return contextlib.nullcontext(sys.stdin if mode == "r" else sys.stdout)
    return open(path, mode, encoding="utf-8")
