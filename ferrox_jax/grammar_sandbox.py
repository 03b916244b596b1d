"""Grammar compilation tried first in child processes, so a native crash costs one request.

llguidance is native code: a constraint it cannot handle may overflow the stack or take
minutes, and in-process either kills the server (SIGSEGV) or holds a worker thread. The
limits in `ferrox_jax/grammar_limits.py` refuse the known shapes; this is the net under
them. `GrammarSandbox.check(spec)` sends the spec to one of a few long-lived child
processes (`python -m ferrox_jax.grammar_sandbox`, started lazily, each holding its own
llguidance tokenizer) which compiles it (`ferrox_jax/grammar_template.py`, the same
translation the server runs) and answers "ok" or the GrammarError message. A
child that dies (a signal) or runs past the timeout is killed and replaced, and the
request gets a GrammarError naming what happened (HTTP 400). Only a spec the child
compiled is compiled again in the server (`GrammarCompiler.compile`), where the result
is cached by spec, so the cost is one round trip and a second compile per new spec
(milliseconds for typical schemas).

Wire: length-prefixed frames (8-byte big-endian length, then UTF-8 JSON) on the child's
stdin/stdout. The first frame is the setup (`vocab_size`, `stop_token_ids`, the HF
tokenizer JSON); the child answers {"ready": true}. Then one frame per spec, one answer
each: {"ok": true, "warnings": [...]} or {"error": "<GrammarError message>"}. A child
whose stdin closes (the server exited) exits.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

from ferrox_jax.constraint import GrammarError, GrammarSpec

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 2
DEFAULT_TIMEOUT_S = 15.0  # per compile; far above a real schema's milliseconds
STARTUP_TIMEOUT_S = 120.0  # importing llguidance and building the tokenizer, on a busy host
_HEADER = struct.Struct(">Q")


class SandboxUnavailable(RuntimeError):
    """No child process could be started (the caller compiles in-process instead)."""


def _write_frame(stream: BinaryIO, obj: Any) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from `fd`, None at EOF; TimeoutError past `deadline` (time.monotonic)."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: float | None) -> Any:
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(header)[0], deadline)
    return None if body is None else json.loads(body)


def spec_to_wire(spec: GrammarSpec) -> dict[str, Any]:
    source = list(spec.source) if isinstance(spec.source, tuple) else spec.source
    return {"kind": spec.kind, "source": source, "syntax": spec.syntax, "strict": spec.strict,
            "max_whitespace_chars": spec.max_whitespace_chars}


def spec_from_wire(obj: dict[str, Any]) -> GrammarSpec:
    source = tuple(obj["source"]) if isinstance(obj["source"], list) else obj["source"]
    return GrammarSpec(obj["kind"], source, syntax=obj["syntax"], strict=obj["strict"],
                       max_whitespace_chars=obj["max_whitespace_chars"])


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _child_env() -> dict[str, str]:
    """The server's environment, with this checkout first on the path (the child runs
    `-m ferrox_jax.grammar_sandbox` from whatever directory the server was started in)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class _Worker:
    """One child process; used by one caller at a time (the pool's queue hands it out)."""

    def __init__(self, setup: dict[str, Any]):
        self.proc = subprocess.Popen([sys.executable, "-m", "ferrox_jax.grammar_sandbox"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=_child_env())
        try:
            _write_frame(self.proc.stdin, setup)
            reply = _read_frame(self.proc.stdout.fileno(), time.monotonic() + STARTUP_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            self.kill()
            raise SandboxUnavailable(f"grammar sandbox did not start: {e or 'no answer in time'}") from e
        if not reply or not reply.get("ready"):
            self.kill()
            raise SandboxUnavailable(f"grammar sandbox did not start: {_describe_exit(self.proc.wait())}")

    def compile(self, spec: GrammarSpec, timeout_s: float) -> dict[str, Any]:
        """The child's answer; GrammarError when it dies or runs past `timeout_s` (the
        worker is then dead: the caller drops it)."""
        try:
            _write_frame(self.proc.stdin, spec_to_wire(spec))
            reply = _read_frame(self.proc.stdout.fileno(), time.monotonic() + timeout_s)
        except TimeoutError:
            self.kill()
            raise GrammarError(f"compiling the constraint took longer than {timeout_s:g} s") from None
        except OSError:
            reply = None
        if reply is None:
            code = self.proc.wait()
            raise GrammarError(f"the grammar compiler failed on this constraint ({_describe_exit(code)}); "
                               "simplify it (fewer or shallower rules / $refs)")
        return reply

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class GrammarSandbox:
    """A small pool of compile children for one tokenizer; thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                 workers: int = DEFAULT_WORKERS, timeout_s: float = DEFAULT_TIMEOUT_S):
        self._setup = {"vocab_size": vocab_size, "stop_token_ids": list(stop_token_ids),
                       "tokenizer_json": tokenizer_json}
        self.timeout_s = timeout_s
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)  # a slot; the child starts on first use
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self.num_crashes = 0  # children lost to a crash or a timeout

    def check(self, spec: GrammarSpec) -> tuple[str, ...]:
        """Compile `spec` in a child; its warnings. Raises GrammarError (invalid, crashed,
        timed out) or SandboxUnavailable (no child could start)."""
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive:
                worker = _Worker(self._setup)
                with self._lock:
                    self._all.append(worker)
            try:
                reply = worker.compile(spec, self.timeout_s)
            except GrammarError:
                with self._lock:
                    self.num_crashes += 1
                    self._all.remove(worker)
                worker = None
                raise
        finally:
            self._idle.put(worker)
        if "error" in reply:
            raise GrammarError(reply["error"])
        return tuple(reply.get("warnings", ()))

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, []
        for worker in workers:
            worker.kill()


_SANDBOXES: dict[tuple[str, int, tuple[int, ...]], GrammarSandbox] = {}
_SANDBOXES_LOCK = threading.Lock()


def shared_sandbox(tokenizer_json: str, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                   workers: int = DEFAULT_WORKERS, timeout_s: float = DEFAULT_TIMEOUT_S) -> GrammarSandbox:
    """The process's sandbox for this tokenizer and these settings (engines of one model
    share its children; `workers` and `timeout_s` are `EngineConfig.grammar_workers` and
    `grammar_timeout_s`)."""
    key = (hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest(), vocab_size, tuple(stop_token_ids),
           workers, timeout_s)
    with _SANDBOXES_LOCK:
        sandbox = _SANDBOXES.get(key)
        if sandbox is None:
            sandbox = _SANDBOXES[key] = GrammarSandbox(tokenizer_json, vocab_size, stop_token_ids,
                                                       workers=max(1, workers), timeout_s=timeout_s)
        return sandbox


@atexit.register
def _close_all() -> None:
    with _SANDBOXES_LOCK:
        for sandbox in _SANDBOXES.values():
            sandbox.close()


# ---------------------------------------------------------------- the child


def _child_main() -> int:
    import llguidance

    from ferrox_jax.grammar_template import compile_template

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    setup = _read_frame(stdin.fileno(), None)
    if setup is None:
        return 0
    lltokenizer = llguidance.LLTokenizer(setup["tokenizer_json"], n_vocab=setup["vocab_size"],
                                         eos_token=setup["stop_token_ids"])
    _write_frame(stdout, {"ready": True})
    while True:
        request = _read_frame(stdin.fileno(), None)
        if request is None:
            return 0
        try:
            _template, warnings = compile_template(lltokenizer, spec_from_wire(request))
            _write_frame(stdout, {"ok": True, "warnings": list(warnings)})
        except GrammarError as e:
            _write_frame(stdout, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - any Python-level failure is this spec's error
            _write_frame(stdout, {"error": f"the grammar compiler could not compile this constraint: {e}"})


if __name__ == "__main__":
    sys.exit(_child_main())
