"""Multi-host serving: one engine whose mesh spans every process of a `jax.distributed` cluster.

JAX is multi-controller: every process must call the same jitted step, with the same
inputs, in the same order, or the collectives inside it never meet. So process 0 (the
*leader*) runs the HTTP server and the scheduler as a single-process server does, and
each step it sends the step's `HostBatch` as bytes (`to_bytes`, lossless) to the other
processes (the *followers*), which run nothing but the runner:

    leader (process 0)                              follower (process i > 0)
    scheduler.schedule() -> HostBatch
    channel.send(B, batch.to_bytes())     ----->    batch = HostBatch.from_bytes(...)
    runner.run(batch, fill_masks)                   runner.run(batch, fill_masks)
      dispatch forward (collectives)      <---->      dispatch forward (collectives)
      fill the grammar bitmask
      channel.send(M, bitmask)            ----->      the bitmask it waits for
      sample, fetch results                           sample (its results are dropped)

Results are read on the leader only. Every array a step returns is replicated over the
mesh, so each process holds a whole copy locally and the leader's fetch needs no
cross-process transfer.

The channel is a plain TCP connection per follower, to the coordinator's host at its
port + 1 (`step_channel_address`), carrying length-prefixed frames: `B` (a batch), `M`
(a bitmask), `D` (a draft model's proposal step: `DraftSender`), `S` (stop), and `H`
(heartbeat, both ways, every second, from a thread of its own: a heartbeat says the
process is alive even while its step waits in a collective, and an idle leader, which
sends no step for as long as no request comes, is not taken for a hung one). It is
chosen over `jax.experimental.multihost_utils.broadcast_one_to_all` because a collective
cannot fail cleanly: a dead peer leaves it waiting, while a socket says at once that the
other end is gone (EOF), and a missing heartbeat says in bounded time that it hung.

Failure is loud and bounded (`timeout_s`, `--multihost-timeout-s`, 10 s by default): a
follower that closed its channel (died) or sent nothing for `timeout_s` (hung: SIGSTOP, a
wedged host) makes the leader's channel call every `on_group_failure` listener with the
reason (the API then answers `/health` 503 with it, ends in-flight requests with an error
event and exits non-zero: `api/multihost_app.py`) and refuse every later step. A follower
whose leader is gone (EOF) or silent for `timeout_s` (no step, no heartbeat: hung) exits
non-zero at once, from its reader thread, whatever its step is waiting for: there is
nothing it could serve alone.

Compiles are shared over the group's key-value store: `ferrox_jax/shared_compiles.py`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import struct
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from ferrox_jax.host_batch import HostBatch

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # the heartbeat period, both ways (shorter under a short timeout: heartbeat_period)
DEFAULT_TIMEOUT_S = 10.0  # a peer silent this long is taken for hung (EngineConfig.multihost_timeout_s)
CONNECT_TIMEOUT_S = 600.0  # followers build and compile before they connect
FOLLOWER_EXIT_CODE = 3  # a follower that lost its leader
FAILURE_NAMING_S = 2.0  # a failed step waits this long for the channel to say which process died
_HEADER = struct.Struct("!cQ")  # frame kind, payload bytes
BATCH, MASK, STOP, HEARTBEAT, HELLO, DRAFT = b"B", b"M", b"S", b"H", b"O", b"D"

_listeners: list[Callable[[str], None]] = []
_channels: list["StepChannel"] = []  # this process's (the leader's), for `close_all`


def heartbeat_period(timeout_s: float) -> float:
    """HEARTBEAT_S, or a quarter of `timeout_s` when that is shorter: a watcher that gives
    up after `timeout_s` of silence sees several beats in every window, so one late beat
    (a busy machine's scheduling) is never taken for a hang."""
    return min(HEARTBEAT_S, timeout_s / 4)


class GroupFailure(RuntimeError):
    """A process of the group died or hung: no step can run any more."""


def on_group_failure(listener: Callable[[str], None]) -> None:
    """Call `listener(reason)` (from the channel's thread) when the group fails."""
    _listeners.append(listener)


def step_channel_address(coordinator_address: str) -> tuple[str, int]:
    """The leader's step channel: the coordinator's host, its port + 1."""
    host, _, port = coordinator_address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port) + 1


def check_mesh(model_axis: int, device_count: int) -> None:
    """Every process must take part in every step: the mesh spans all global devices."""
    if model_axis != device_count:
        raise ValueError(f"multi-host: the mesh must span every process's devices; --tensor-parallel "
                         f"{model_axis} with {device_count} devices in the cluster (use {device_count})")


def place_on_mesh(tree: Any, shardings: Any) -> Any:
    """`jax.device_put(tree, shardings)`; on a mesh spanning several processes, each process
    supplies its own shards from its local copy of every leaf (the weights every process
    read), with no cross-process check or transfer."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(leaf: Any, sharding: Any) -> jax.Array:
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def _send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    sock.sendall(_HEADER.pack(kind, len(payload)) + payload)


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    chunks, left = [], num_bytes
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, size = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return kind, _recv_exact(sock, size) if size else b""


class StepChannel:
    """The leader's side: accepts the followers, sends them every step, watches them."""

    def __init__(self, address: tuple[str, int], num_followers: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.num_followers = num_followers
        self.timeout_s = timeout_s
        self.failure: str | None = None
        self._failed = threading.Event()
        self._followers: dict[int, socket.socket] = {}
        self._lock = threading.Lock()  # the owner thread sends; watchers may fail the group
        self._send_lock = threading.Lock()  # the owner's frames and the heartbeats never interleave
        self._all_connected = threading.Event()
        self._server = socket.create_server(("", address[1]))
        _channels.append(self)
        threading.Thread(target=self._accept, name="ferrox-step-accept", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="ferrox-leader-heartbeat", daemon=True).start()

    def _accept(self) -> None:
        while len(self._followers) < self.num_followers:
            try:
                conn, _ = self._server.accept()
                conn.settimeout(self.timeout_s)
                kind, payload = _recv_frame(conn)
            except (OSError, EOFError, struct.error) as e:
                log.warning("step channel: a connection failed its hello: %s", e)
                continue
            if kind != HELLO:
                conn.close()
                continue
            process_id = int(payload)
            with self._send_lock:
                self._followers[process_id] = conn
            log.info("step channel: follower %d connected", process_id)
            threading.Thread(target=self._watch, args=(process_id, conn), name=f"ferrox-watch-{process_id}",
                             daemon=True).start()
        self._server.close()
        self._all_connected.set()

    def _watch(self, process_id: int, conn: socket.socket) -> None:
        """Reads the follower's heartbeats; EOF or `timeout_s` of silence fails the group.
        The same timeout bounds the leader's sends to it (a send that cannot go through
        for that long is a hung follower too)."""
        try:
            while self.failure is None:
                _recv_frame(conn)
        except EOFError:
            self.fail(f"follower process {process_id} closed its step channel (it exited or crashed)")
        except TimeoutError:
            self.fail(f"follower process {process_id} sent no heartbeat for {self.timeout_s:g} s (hung)")
        except OSError as e:
            self.fail(f"follower process {process_id}: step channel error: {e}")

    def wait_followers(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        if not self._all_connected.wait(timeout_s):
            missing = sorted(set(range(1, self.num_followers + 1)) - set(self._followers))
            raise TimeoutError(f"multi-host: follower processes {missing} did not connect within {timeout_s:g} s")

    def fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        self._failed.set()
        log.error("multi-host group failed: %s", reason)
        for listener in list(_listeners):
            listener(reason)

    def wait_failure(self, timeout_s: float) -> bool:
        """Whether the group has failed, waiting up to `timeout_s` for it to."""
        return self._failed.wait(timeout_s)

    @contextlib.contextmanager
    def naming_failures(self):
        """Around a step: a peer that died mid-step breaks the step's collective (gloo:
        "connection reset") about when its channel closes, so the step's error becomes a
        `GroupFailure` naming the process rather than the socket."""
        try:
            yield
        except Exception as e:
            if self.wait_failure(FAILURE_NAMING_S):
                raise GroupFailure(self.failure) from e
            raise

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        if self.failure is not None:
            raise GroupFailure(self.failure)
        with self._send_lock:
            for process_id, conn in sorted(self._followers.items()):
                try:
                    _send_frame(conn, kind, payload)
                except OSError as e:
                    self.fail(f"follower process {process_id}: sending a step failed: {e}")
                    raise GroupFailure(self.failure) from e

    def _heartbeat(self) -> None:
        """Every heartbeat period, an `H` to every connected follower: an idle or busy leader is alive."""
        while self.failure is None:
            time.sleep(heartbeat_period(self.timeout_s))
            with contextlib.suppress(GroupFailure):
                self.send(HEARTBEAT)

    def close(self) -> None:
        """Tells the followers to stop (a clean shutdown) and closes the connections."""
        with self._lock:  # no heartbeat, no step, no failure report after the stop frame
            self.failure = self.failure or "closed"
        with self._send_lock:
            for conn in self._followers.values():
                try:
                    _send_frame(conn, STOP)
                    conn.close()
                except OSError:
                    pass


def close_all() -> None:
    """Stops this process's followers (a leader's clean exit)."""
    for channel in _channels:
        channel.close()


class BroadcastRunner:
    """The leader's runner: sends each step to the followers, then runs it itself.
    Everything else is the wrapped `ModelRunner`'s."""

    def __init__(self, runner: Any, channel: StepChannel) -> None:
        self._runner = runner
        self.channel = channel
        if runner.draft is not None:  # --speculative draft: its proposal steps go to the followers too
            runner.draft.proposals = DraftSender(runner.draft.runner, channel)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def warmup(self, progress: Callable | None = None, num_threads: int | None = None) -> float:
        """Compiles every shape, then waits until every follower (which compiled the same
        shapes) is connected: no step is served before the whole group can run it."""
        seconds = self._runner.warmup(progress, num_threads)
        self.channel.wait_followers()
        return seconds

    def run(self, batch: HostBatch, fill_masks: Callable | None = None) -> Any:
        self.channel.send(BATCH, batch.to_bytes())

        def fill_and_send(b: HostBatch, forward_is_done: Callable[[], bool]) -> None:
            fill_masks(b, forward_is_done)
            self.channel.send(MASK, np.ascontiguousarray(b.bitmask, np.int32).tobytes())

        with self.channel.naming_failures():
            return self._runner.run(batch, fill_and_send if fill_masks is not None else None)


class DraftSender:
    """The leader's draft runner for proposal steps (`ferrox_jax/draft.py`): sends each to
    the followers (a `D` frame: the batch, which carries its block copies), then runs it.
    The draft's mirror of a target step needs no frame: each process's target runner
    mirrors the `B` batch it runs. Proposal rows are never constrained (no bitmask)."""

    def __init__(self, runner: Any, channel: StepChannel) -> None:
        self._runner = runner
        self.channel = channel

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def run(self, batch: HostBatch, fill_masks: Callable | None = None) -> Any:
        if fill_masks is not None or batch.has_constrained_rows:
            raise ValueError("a draft proposal step has no grammar-constrained rows")
        self.channel.send(DRAFT, batch.to_bytes())
        with self.channel.naming_failures():
            return self._runner.run(batch)


def follow(runner: Any, address: tuple[str, int], process_id: int,
           on_connected: Callable[[], None] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """A follower's whole life after warm-up: connect, run every step the leader sends.

    Returns 0 on the leader's stop frame; exits the process with FOLLOWER_EXIT_CODE when
    the leader is gone or silent for `timeout_s` (its device calls may be stuck in a
    collective: no clean return)."""
    sock = _connect(address)
    _send_frame(sock, HELLO, str(process_id).encode())
    send_lock = threading.Lock()
    threading.Thread(target=_heartbeat, args=(sock, send_lock, heartbeat_period(timeout_s)), name="ferrox-heartbeat",
                     daemon=True).start()
    frames: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_leader, args=(sock, frames, process_id, timeout_s), name="ferrox-leader-reader",
                     daemon=True).start()
    if on_connected is not None:
        on_connected()
    log.info("follower %d: connected to the leader at %s:%d", process_id, *address)
    words = runner.bitmask_words
    while True:
        kind, payload = frames.get()
        if kind == STOP:
            return 0
        if kind == DRAFT and runner.draft is not None:
            runner.draft.runner.run(HostBatch.from_bytes(payload))
            continue
        if kind != BATCH:
            leader_gone(f"follower {process_id}: unexpected frame {kind!r} from the leader; exiting")
        batch = HostBatch.from_bytes(payload)

        def fill(b: HostBatch, _is_done: Callable[[], bool]) -> None:
            mask_kind, mask = frames.get()
            if mask_kind != MASK:
                leader_gone(f"follower {process_id}: expected the step's bitmask, got {mask_kind!r}; exiting")
            b.bitmask = np.frombuffer(mask, np.int32).reshape(b.num_rows, words).copy()

        runner.run(batch, fill if batch.has_constrained_rows else None)


def _read_leader(sock: socket.socket, frames: queue.SimpleQueue, process_id: int, timeout_s: float) -> None:
    """The follower's reader: every frame but heartbeats goes to `frames`; EOF, an error or
    `timeout_s` without any frame (the leader sends a heartbeat every second, idle or
    not) ends the process, even while the main thread waits in a collective."""
    sock.settimeout(timeout_s)
    try:
        while True:
            kind, payload = _recv_frame(sock)
            if kind != HEARTBEAT:
                frames.put((kind, payload))
            if kind == STOP:
                return
    except TimeoutError:
        leader_gone(f"follower {process_id}: no step and no heartbeat from the leader for {timeout_s:g} s "
                    "(hung); exiting")
    except (EOFError, OSError, struct.error) as e:
        leader_gone(f"follower {process_id}: the leader's step channel closed ({e}); exiting")


def _connect(address: tuple[str, int]) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return socket.create_connection(address, timeout=5.0)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _heartbeat(sock: socket.socket, lock: threading.Lock, period_s: float) -> None:
    while True:
        time.sleep(period_s)
        try:
            with lock:
                _send_frame(sock, HEARTBEAT)
        except OSError as e:
            leader_gone(f"follower: the leader stopped taking heartbeats ({e}); exiting")


def leader_gone(message: str) -> None:
    """A follower without its leader: say why and exit non-zero now, whatever its threads are doing."""
    log.error("%s", message)
    logging.shutdown()
    os._exit(FOLLOWER_EXIT_CODE)
