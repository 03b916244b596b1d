"""Multi-host serving: one engine whose mesh spans every process of a `jax.distributed` cluster.

JAX is multi-controller: every process must call the same jitted step, with the same
inputs, in the same order, or the collectives inside it never meet. So process 0 (the
*leader*) runs the HTTP server and the scheduler as a single-process server does, and
each step it sends the step's `HostBatch` as bytes (`to_bytes`, lossless) to the other
processes (the *followers*), which run nothing but the runner:

    leader (process 0)                              follower (process i > 0)
    scheduler.schedule() -> HostBatch
    runner.forward(batch): send B         ----->    batch = HostBatch.from_bytes(...)
      dispatch forward (collectives)      <---->    runner.forward(batch) (collectives)
    fill the grammar bitmask
    runner.sample(pending, bitmask):
      send M (constrained rows only)      ----->    the bitmask it waits for
      sample, fetch results                         runner.sample(...) (results dropped)

The follower replays the leader's verbs in the leader's order (`follow`): the leader's
runner (`ferrox_jax/multihost_runner.py:BroadcastRunner`) sends a frame where the
follower needs one to know what comes next.

Results are read on the leader only. Every array a step returns is replicated over the
mesh, so each process holds a whole copy locally and the leader's fetch needs no
cross-process transfer.

The channel is a plain TCP connection per follower, to the coordinator's host at its
port + 1 (`step_channel_address`; the leader listens on that interface only, never on
every one), carrying length-prefixed frames (`ferrox_jax/step_frames.py`): `B` (a batch),
`M` (a bitmask), `D` (a draft model's proposal step: `DraftSender`), `S` (stop), and `H`
(heartbeat, both ways, every second, from a thread of its own: a heartbeat says the
process is alive even while its step waits in a collective, and an idle leader, which
sends no step for as long as no request comes, is not taken for a hung one). It is chosen
over `jax.experimental.multihost_utils.broadcast_one_to_all` because a collective
cannot fail cleanly: a dead peer leaves it waiting, while a socket says at once that the
other end is gone (EOF), and a missing heartbeat says in bounded time that it hung.

No step goes over a connection before both ends proved they know the group's secret
(`ferrox_jax/step_channel_auth.py`: HMAC challenge-response both ways, on
`--multihost-secret` or, on loopback, a secret the leader generates for its followers).
The leader runs each handshake on a thread of its own, under a deadline, so a stranger
that connects and idles never holds up the accept loop; each follower slot is taken once,
by a connection that proved the secret, and every connection that fails (garbage, a
malformed or oversized frame, a wrong proof, a taken slot) is refused with one log line.
Once every follower has joined, the leader stops listening.

Failure is loud and bounded (`timeout_s`, `--multihost-timeout-s`, 10 s by default): a
follower that closed its channel (died) or sent nothing for `timeout_s` (hung: SIGSTOP, a
wedged host) makes the leader's channel tell its failure listener, the engine's batcher,
for which a lost peer is one more fault kind on the watchdog's path
(`ContinuousBatcher.lose_peer`, `ferrox_jax/step_faults.py`: every in-flight request ends
with an error event naming the process, the engine is dead, `/health` answers 503 with the
reason and `ferrox serve` exits non-zero), and refuse every later step. A follower
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
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from ferrox_jax.host_batch import HostBatch, bitmask_words
from ferrox_jax.step_channel_auth import HandshakeError, Refused, answer, follower_key, join, leader_key, refuse
from ferrox_jax.step_frames import (BATCH, DRAFT, HEARTBEAT, MASK, STOP, WELCOME, FrameError, recv_frame,
                                    send_frame)

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # the heartbeat period, both ways (shorter under a short timeout: heartbeat_period)
DEFAULT_TIMEOUT_S = 10.0  # a peer silent this long is taken for hung (EngineConfig.multihost_timeout_s)
CONNECT_TIMEOUT_S = 600.0  # followers build and compile before they connect
FOLLOWER_EXIT_CODE = 3  # a follower that lost its leader
FAILURE_NAMING_S = 2.0  # a failed step waits this long for the channel to say which process died
# Handshakes in flight at once: enough for every follower of a large group connecting
# together; a connection beyond it is refused at once rather than queued behind strangers.
MAX_PENDING_HANDSHAKES = 64
ACCEPT_POLL_S = 0.5  # the accept loop looks this often whether the group formed or the channel closed

_channels: list["StepChannel"] = []  # this process's (the leader's), for `close_all`


def heartbeat_period(timeout_s: float) -> float:
    """HEARTBEAT_S, or a quarter of `timeout_s` when that is shorter: a watcher that gives
    up after `timeout_s` of silence sees several beats in every window, so one late beat
    (a busy machine's scheduling) is never taken for a hang."""
    return min(HEARTBEAT_S, timeout_s / 4)


class GroupFailure(RuntimeError):
    """A process of the group died or hung: no step can run any more."""


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


def _listen(address: tuple[str, int]) -> socket.socket:
    """A listening socket on the coordinator's interface alone (an IPv4 or IPv6 literal, or
    a name resolved here), never on every interface of the host."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM)[0]
    return socket.create_server(sockaddr, family=family)


def _peer(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)


class StepChannel:
    """The leader's side: admits the followers, sends them every step, watches them.

    Args:
      address: (the coordinator's host, its port + 1): `step_channel_address`.
      timeout_s: a follower silent this long is hung; also each handshake's deadline.
      secret: the group's shared secret (`--multihost-secret`); None: on loopback, one
        generated for the followers on this machine (`ferrox_jax/step_channel_auth.py`).
    """

    def __init__(self, address: tuple[str, int], num_followers: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 secret: str | None = None) -> None:
        self.num_followers = num_followers
        self.timeout_s = timeout_s
        self.failure: str | None = None
        self._failed = threading.Event()
        self._failure_listeners: list[Callable[[str], None]] = []
        self._followers: dict[int, socket.socket] = {}
        self._lock = threading.Lock()  # the owner thread sends; watchers may fail the group
        self._send_lock = threading.Lock()  # the owner's frames and the heartbeats never interleave
        self._all_connected = threading.Event()
        # The secret file (loopback, none given) is written before the channel listens: a
        # follower reads it once connected, so it never reads a previous group's.
        self._key, self._secret_file = leader_key(address, secret)
        self._server = _listen(address)
        self._server.settimeout(ACCEPT_POLL_S)
        _channels.append(self)
        threading.Thread(target=self._accept, name="ferrox-step-accept", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="ferrox-leader-heartbeat", daemon=True).start()

    def _accept(self) -> None:
        """Hands each connection to a handshake thread of its own and goes back to accepting
        at once: a peer that connects and idles holds its own thread until its deadline,
        never this loop. Stops listening once every follower has joined (or on close)."""
        pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        while not self._all_connected.is_set() and self.failure is None:
            try:
                conn, peer = self._server.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self.failure is None:  # else `close` closed the socket under this loop
                    log.warning("step channel: accepting a connection failed: %s", e)
                    time.sleep(ACCEPT_POLL_S)
                continue
            if not pending.acquire(blocking=False):
                log.warning("step channel: refused a connection from %s: %d handshakes already in progress",
                            _peer(peer), MAX_PENDING_HANDSHAKES)
                conn.close()
                continue
            threading.Thread(target=self._admit, args=(conn, peer, pending), name="ferrox-step-handshake",
                             daemon=True).start()
        self._server.close()
        self._forget_secret_file()

    def _admit(self, conn: socket.socket, peer: Any, pending: threading.BoundedSemaphore) -> None:
        """One connection's handshake, then its slot: a refusal is one log line, never an
        exception out of this thread, and leaves the slot free for the real follower."""
        try:
            process_id = answer(conn, self._key, self.num_followers, self._followers.__contains__, self.timeout_s)
            self._take_slot(process_id, conn, peer)
        except Refused as e:
            log.warning("step channel: refused a connection from %s: %s", _peer(peer), e)
            conn.close()
            return
        finally:
            pending.release()
        threading.Thread(target=self._watch, args=(process_id, conn), name=f"ferrox-watch-{process_id}",
                         daemon=True).start()

    def _take_slot(self, process_id: int, conn: socket.socket, peer: Any) -> None:
        """The slot, once: two connections that both proved the secret for one id race here,
        under the lock the heartbeats take, so the welcome precedes every other frame. The
        join is logged before `wait_followers` can return."""
        with self._send_lock:
            if process_id in self._followers:
                refuse(conn, f"follower slot {process_id} is already taken")
            try:
                conn.settimeout(self.timeout_s)
                send_frame(conn, WELCOME)
            except OSError as e:
                raise Refused(f"the connection broke before its welcome: {e}") from None
            self._followers[process_id] = conn
            log.info("step channel: follower %d joined from %s", process_id, _peer(peer))
            if len(self._followers) == self.num_followers:
                self._all_connected.set()

    def _forget_secret_file(self) -> None:
        """The generated loopback secret leaves the disk once nobody needs to read it."""
        if self._secret_file is not None:
            self._secret_file.unlink(missing_ok=True)

    def _watch(self, process_id: int, conn: socket.socket) -> None:
        """Reads the follower's heartbeats; EOF or `timeout_s` of silence fails the group.
        The same timeout bounds the leader's sends to it (a send that cannot go through
        for that long is a hung follower too)."""
        try:
            while self.failure is None:
                recv_frame(conn, max_bytes=0)  # a follower sends heartbeats only
        except FrameError:
            self.fail(f"follower process {process_id} sent a frame the leader does not take")
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

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """`listener(reason)` once the group fails (from the thread that found out; at once
        when it has): the engine's batcher, for which a lost peer is a fault kind
        (`ContinuousBatcher.lose_peer`)."""
        with self._lock:
            failure = self.failure if self.failure != "closed" else None
            if failure is None:
                self._failure_listeners.append(listener)
        if failure is not None:
            listener(failure)

    def fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            listeners, self._failure_listeners = self._failure_listeners, []
        self._failed.set()
        log.error("multi-host group failed: %s", reason)
        for listener in listeners:
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
                    send_frame(conn, kind, payload)
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
        self._server.close()
        self._forget_secret_file()
        with self._send_lock:
            for conn in self._followers.values():
                try:
                    send_frame(conn, STOP)
                    conn.close()
                except OSError:
                    pass


def close_all() -> None:
    """Stops this process's followers (a leader's clean exit)."""
    for channel in _channels:
        channel.close()


def follow(runner: Any, address: tuple[str, int], process_id: int,
           on_connected: Callable[[], None] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
           secret: str | None = None, draft: Any = None) -> int:
    """A follower's whole life after warm-up: connect, prove the secret (and check the
    leader's proof), replay every step the leader sends on `runner` (and `draft`, the draft
    model's runner under `--speculative draft`), verb for verb in the leader's order: a `B`
    batch is the target's forward, the draft's mirror of it, the `M` bitmask when a row is
    constrained, the sample; a `D` batch a draft proposal step (forward, sample).

    `secret` is the group's (`--multihost-secret`); None: on loopback, the one the leader
    generated, read once the connection is accepted (the leader writes it before it listens).

    Returns 0 on the leader's stop frame; exits the process with FOLLOWER_EXIT_CODE when
    the handshake fails or the leader is gone or silent for `timeout_s` (its device calls
    may be stuck in a collective: no clean return)."""
    sock = _connect(address)
    try:
        join(sock, follower_key(address, secret), process_id, timeout_s)
    except HandshakeError as e:
        leader_gone(f"follower {process_id}: cannot join the step channel at {_peer(address)}: {e}; exiting")
    sock.settimeout(timeout_s)
    send_lock = threading.Lock()
    threading.Thread(target=_heartbeat, args=(sock, send_lock, heartbeat_period(timeout_s)), name="ferrox-heartbeat",
                     daemon=True).start()
    frames: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_leader, args=(sock, frames, process_id, timeout_s), name="ferrox-leader-reader",
                     daemon=True).start()
    if on_connected is not None:
        on_connected()
    log.info("follower %d: connected to the leader at %s:%d", process_id, *address)
    words = bitmask_words(runner.geometry.vocab_size)
    while True:
        kind, payload = frames.get()
        if kind == STOP:
            return 0
        if kind == DRAFT and draft is not None:
            draft.sample(draft.forward(HostBatch.from_bytes(payload)), None)
            continue
        if kind != BATCH:
            leader_gone(f"follower {process_id}: unexpected frame {kind!r} from the leader; exiting")
        batch = HostBatch.from_bytes(payload)
        pending = runner.forward(batch)
        if draft is not None:
            draft.forward(batch)  # the draft's mirror, as the leader's tick runs it
        bitmask = None
        if batch.has_constrained_rows:
            mask_kind, mask = frames.get()
            if mask_kind != MASK:
                leader_gone(f"follower {process_id}: expected the step's bitmask, got {mask_kind!r}; exiting")
            bitmask = np.frombuffer(mask, np.int32).reshape(batch.num_rows, words).copy()
        runner.sample(pending, bitmask)


def _read_leader(sock: socket.socket, frames: queue.SimpleQueue, process_id: int, timeout_s: float) -> None:
    """The follower's reader: every frame but heartbeats goes to `frames`; EOF, an error or
    `timeout_s` without any frame (the leader sends a heartbeat every second, idle or
    not) ends the process, even while the main thread waits in a collective."""
    sock.settimeout(timeout_s)
    try:
        while True:
            kind, payload = recv_frame(sock)
            if kind != HEARTBEAT:
                frames.put((kind, payload))
            if kind == STOP:
                return
    except TimeoutError:
        leader_gone(f"follower {process_id}: no step and no heartbeat from the leader for {timeout_s:g} s "
                    "(hung); exiting")
    except (EOFError, OSError) as e:
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
                send_frame(sock, HEARTBEAT)
        except OSError as e:
            leader_gone(f"follower: the leader stopped taking heartbeats ({e}); exiting")


def leader_gone(message: str) -> None:
    """A follower without its leader: say why and exit non-zero now, whatever its threads are doing."""
    log.error("%s", message)
    logging.shutdown()
    os._exit(FOLLOWER_EXIT_CODE)
