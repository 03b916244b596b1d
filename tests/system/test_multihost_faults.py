"""Multi-host failures on a local CPU cluster of the tiny model (tests/support/multihost_cluster.py:
`ferrox serve` as 2 processes, tensor parallel, gloo collectives): an idle leader is not
taken for a hung one; a follower killed or hung (SIGSTOP) mid-stream ends the stream with
an error event, turns the leader's /health 503 with the reason and makes the leader exit
non-zero; followers whose leader was killed or hung exit non-zero; SIGTERM to the leader
mid-stream stops the whole group, every process exiting 0.

The step channel's door (ferrox_jax/step_channel_auth.py), in-process against a real
`StepChannel` and on a real group: it listens on the coordinator's host only; strangers
that connect during start-up (no secret, a wrong one, malformed or oversized frames, an
early close, silence) are refused, one log line each, and the group still forms and
serves; a follower slot is taken once; a follower leaves a channel that cannot prove the
secret; a non-loopback coordinator without a secret refuses to start; the secret a
loopback leader generates is in a file only its user can read, gone once the group formed.

What the group computes (the single-process tokens, shared compiles, drafts) is
tests/system/test_multihost.py."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from api.app import DRAIN_ABORT_REASON
from ferrox_jax.config import EngineConfig
from ferrox_jax.multihost import StepChannel
from ferrox_jax.step_channel_auth import (HELLO_PAYLOAD, HandshakeError, join, loopback_secret_path,
                                          publish_loopback_secret, read_loopback_secret)
from ferrox_jax.step_frames import CHALLENGE, HEADER, HEARTBEAT, HELLO, PROOF, REFUSE, recv_frame, send_frame
from tests.support.multihost_cluster import (REPO, SECRET, TIMEOUT_S, check_shared_compiles, cluster, complete_all,
                                             tiny_reference_replies)
from tests.support.server_harness import free_port, parse_sse


@pytest.fixture(scope="module")
def tiny_reference() -> list[dict]:
    return tiny_reference_replies()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("multihost")
    with cluster(2, log_dir, extra=("--multihost-timeout-s", str(TIMEOUT_S))) as (urls, procs):
        yield urls, procs, log_dir


def test_an_idle_leader_is_not_taken_for_hung(two_processes, tiny_reference):
    (leader, follower), procs, log_dir = two_processes
    time.sleep(TIMEOUT_S + 2)  # the condition under test: no request for longer than the timeout
    assert all(proc.poll() is None for proc in procs), "the leader's heartbeats keep its followers"
    assert httpx.get(follower + "/health").status_code == 200 and httpx.get(leader + "/health").status_code == 200
    # Two at a time: decode steps of 2 rows, on executables process 0 compiled for both.
    assert complete_all(leader, concurrent=True) == tiny_reference, "tp2 across 2 processes: one process's tokens"
    assert "ferrox_recompiles_after_warmup_total 0.0" in httpx.get(leader + "/metrics").text
    check_shared_compiles(log_dir, 2)


def stream_until(leader: str, act) -> tuple[list, float]:
    """A long greedy stream; `act()` once its first event arrived; (events, when act ran)."""
    body = {"prompt": "Count", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", leader + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)  # streaming
        acted_at = time.monotonic()
        act()
        rest = "\n".join(lines)
    return parse_sse(rest + "\n\n"), acted_at


def check_group_failed(leader: str, leader_proc, log_dir: Path, events: list, acted_at: float, why: str) -> None:
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and "follower process 1" in errors[-1]["error"]["message"], events[-3:]
    assert why in errors[-1]["error"]["message"]
    with contextlib.suppress(httpx.TransportError):  # the leader may be gone already
        health = httpx.get(leader + "/health", timeout=5)
        assert health.status_code == 503 and "follower process 1" in health.json()["reason"], health.text
    assert time.monotonic() - acted_at < 30, "the failure is reported within 30 s"
    assert events[-1] == "[DONE]" or "error" in events[-1], "the error event closes the stream"
    assert leader_proc.wait(60) != 0, "the leader exits non-zero so a supervisor restarts the group"
    assert "multi-host group failed" in (log_dir / "process-0.log").read_text()


def test_a_killed_follower_fails_the_stream_the_health_and_the_leader(two_processes):
    (leader, _), (leader_proc, follower_proc), log_dir = two_processes
    events, killed_at = stream_until(leader, lambda: follower_proc.send_signal(signal.SIGKILL))
    check_group_failed(leader, leader_proc, log_dir, events, killed_at, "")


def test_a_hung_follower_fails_the_stream_the_health_and_the_leader(tmp_path):
    # With --no-share-compiles (every process compiles its own shapes): the switch is covered here.
    extra = ("--multihost-timeout-s", str(TIMEOUT_S), "--no-share-compiles")
    with cluster(2, tmp_path, extra=extra) as ((leader, _), procs):
        events, stopped_at = stream_until(leader, lambda: procs[1].send_signal(signal.SIGSTOP))
        check_group_failed(leader, procs[0], tmp_path, events, stopped_at, f"no heartbeat for {TIMEOUT_S} s (hung)")
    assert "from process 0 (" not in (tmp_path / "process-1.log").read_text(), "the follower compiled itself"


def test_followers_of_a_hung_leader_exit_non_zero(tmp_path):
    with cluster(2, tmp_path, extra=("--multihost-timeout-s", str(TIMEOUT_S))) as ((leader, _), procs):
        with httpx.Client(timeout=120) as client, client.stream("POST", leader + "/v1/completions", json={
                "prompt": "Count", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())
            stopped_at = time.monotonic()
            procs[0].send_signal(signal.SIGSTOP)  # mid-stream: the follower may wait in a collective
            assert procs[1].wait(TIMEOUT_S + 30) == 3, "a follower whose leader hung exits 3"
        assert time.monotonic() - stopped_at < TIMEOUT_S + 30
        follower_log = (tmp_path / "process-1.log").read_text()
        assert "no step and no heartbeat from the leader" in follower_log
        assert "Traceback" not in follower_log, "the follower ran its steps until the leader stopped"


def test_sigterm_to_the_leader_stops_the_whole_group(tmp_path):
    # A 2 s drain: the 1500-token stream either finishes in it or is ended with an error event.
    # The group shares a given secret (the leader's flag, the follower's variable).
    with cluster(2, tmp_path, extra=("--shutdown-timeout", "2"), secret=SECRET) as ((leader, _), procs):
        events, signalled_at = stream_until(leader, lambda: procs[0].send_signal(signal.SIGTERM))
        assert events[-1] == "[DONE]" or DRAIN_ABORT_REASON in events[-1]["error"]["message"], events[-3:]
        codes = [proc.wait(30) for proc in procs]
        assert codes == [0, 0], f"the leader drains and stops its follower; both exit 0: {codes}"
        assert time.monotonic() - signalled_at < 30
    for i in range(2):
        log = (tmp_path / f"process-{i}.log").read_text()
        assert SECRET not in log, f"process {i} never logs the multi-host secret"


# ---------------------------------------------------------------- the step channel's door

# Connections that are not a follower's hello, as a stranger (or a scanner, or an older
# ferrox) sends them, with the reason the leader logs for each.
MALFORMED = {
    "the old protocol's hello": (HEADER.pack(HELLO, 1) + b"1", "not a follower's hello"),
    "a non-numeric id": (HEADER.pack(HELLO, 3) + b"abc", "not a follower's hello"),
    "a hello of the wrong length": (HEADER.pack(HELLO, 40) + bytes(40), "a frame of 40 bytes"),
    "an HTTP request": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "where at most 36 are taken"),
    "an oversize length prefix": (HEADER.pack(HELLO, 2**63), "a frame of 9223372036854775808 bytes"),
    "an early close": (HEADER.pack(HELLO, HELLO_PAYLOAD.size) + bytes(10), "closed the connection before"),
    "an id outside the group": (HEADER.pack(HELLO, HELLO_PAYLOAD.size) + HELLO_PAYLOAD.pack(7, bytes(32)),
                                "follower id 7 is not one of this group's"),
    "a heartbeat first": (HEADER.pack(HEARTBEAT, 0), "not a follower's hello"),
}
REFUSED = "step channel: refused a connection from"


@contextlib.contextmanager
def step_channel(num_followers: int = 1, timeout_s: float = 10.0):
    """A leader's StepChannel on 127.0.0.1 sharing SECRET; (channel, address); closed on the way out."""
    address = ("127.0.0.1", free_port())
    channel = StepChannel(address, num_followers, timeout_s, secret=SECRET)
    try:
        yield channel, address
    finally:
        channel.close()


def joined(address: tuple[str, int], process_id: int, secret: str = SECRET) -> socket.socket:
    """A follower's connection, through the real follower's handshake."""
    sock = socket.create_connection(address, timeout=10)
    join(sock, secret.encode(), process_id, 10.0)
    return sock


def frames_until_closed(sock: socket.socket, timeout_s: float = 20.0) -> list[bytes]:
    """The kinds of the frames `sock` gets until the other end closes it (or `timeout_s`)."""
    kinds, deadline = [], time.monotonic() + timeout_s
    with contextlib.suppress(EOFError, OSError), sock:
        while True:
            kinds.append(recv_frame(sock, deadline=deadline)[0])
    return kinds


def stranger(address: tuple[str, int], raw: bytes) -> list[bytes]:
    """Sends `raw` (then, for a truncated hello, closes its sending side); what it got back."""
    sock = socket.create_connection(address, timeout=10)
    sock.sendall(raw)
    if raw.startswith(HEADER.pack(HELLO, HELLO_PAYLOAD.size)) and len(raw) < HEADER.size + HELLO_PAYLOAD.size:
        sock.shutdown(socket.SHUT_WR)
    return frames_until_closed(sock)


def stranger_with_a_proof(address: tuple[str, int], key: bytes | None) -> list[bytes]:
    """A well-formed hello as follower 1, then a proof made with `key` (None: an empty one)."""
    sock = socket.create_connection(address, timeout=10)
    nonce = os.urandom(32)
    send_frame(sock, HELLO, HELLO_PAYLOAD.pack(1, nonce))
    kind, payload = recv_frame(sock, deadline=time.monotonic() + 10)
    assert kind == CHALLENGE, f"a well-formed hello gets the leader's challenge, not {kind!r}"
    message = b"ferrox step channel: follower\0" + (1).to_bytes(4, "big") + payload[:32] + nonce
    send_frame(sock, PROOF, hmac.new(key, message, hashlib.sha256).digest() if key else b"")
    return [kind] + frames_until_closed(sock)


def listening_hosts(port: int) -> list[str]:
    """The local addresses of the sockets listening on `port`, from /proc/net/tcp and tcp6."""
    hosts = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address_hex, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address_hex)  # 32-bit words in the host's (little-endian) order
                hosts.append(socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
    return hosts


def test_the_step_channel_listens_on_the_coordinators_host_only():
    with step_channel() as (_, address):
        assert listening_hosts(address[1]) == ["127.0.0.1"], \
            "the step channel binds the coordinator's interface, not every interface"


def test_a_follower_slot_is_taken_once_and_a_second_hello_for_it_is_refused(caplog):
    with step_channel(num_followers=2) as (channel, address):
        first = joined(address, 1)
        with pytest.raises(HandshakeError, match="follower slot 1 is already taken"):
            joined(address, 1)  # even with the secret: the slot is the first follower's
        second = joined(address, 2)  # held open: a closed follower fails the group
        channel.wait_followers(10)
        assert recv_frame(first, deadline=time.monotonic() + 10)[0] == HEARTBEAT, "the first follower keeps its slot"
        second.close()
    assert caplog.text.count(REFUSED) == 1, "the second hello for slot 1 is refused in one log line"


@pytest.mark.parametrize("key", [b"not the group's secret", None], ids=["a wrong secret", "no secret"])
def test_a_stranger_without_the_secret_is_refused_and_the_follower_still_joins(caplog, key):
    caplog.set_level(logging.INFO, logger="ferrox_jax.multihost")
    with step_channel() as (channel, address):
        got = stranger_with_a_proof(address, key)
        assert got == [CHALLENGE, REFUSE], f"a wrong proof gets a refusal and the door, never the welcome: {got}"
        joined(address, 1)  # the slot the stranger asked for is still free
        channel.wait_followers(10)
    assert "did not prove it knows the multi-host secret" in caplog.text
    assert "follower 1 joined" in caplog.text
    assert SECRET not in caplog.text, "the secret is never logged"


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_hello_is_refused_in_one_line_and_the_follower_still_joins(caplog, case):
    raw, reason = MALFORMED[case]
    with step_channel() as (channel, address):
        got = stranger(address, raw)
        assert set(got) <= {REFUSE}, f"{case}: refused, never a step or the welcome: {got}"
        joined(address, 1)  # the accept loop survived it
        channel.wait_followers(10)
    refusals = [r for r in caplog.records if REFUSED in r.getMessage()]
    assert len(refusals) == 1 and reason in refusals[0].getMessage(), f"{case}: one line saying why: {caplog.text}"
    assert not any(r.exc_info for r in caplog.records), f"{case}: a refusal, not an exception: {caplog.text}"


def test_an_idle_stranger_holds_up_neither_the_accept_loop_nor_a_follower(caplog):
    timeout_s = 6.0  # the handshake's deadline
    with step_channel(timeout_s=timeout_s) as (channel, address):
        idle = socket.create_connection(address)  # connects, says nothing
        t0 = time.monotonic()
        joined(address, 1)
        channel.wait_followers(10)
        assert time.monotonic() - t0 < timeout_s / 2, "the follower joined while the stranger idled"
        assert frames_until_closed(idle) == [], "the idle stranger gets nothing, then the door"
        assert time.monotonic() - t0 < 2 * timeout_s, "the idle stranger is dropped at the handshake's deadline"
    assert f"did not finish the handshake within {timeout_s:g} s" in caplog.text


def fake_leader(challenge: bytes) -> tuple[tuple[str, int], list]:
    """A listener that answers one hello with `challenge` (a frame's bytes) and records what
    the follower sends next ("closed" when nothing)."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list = []

    def serve() -> None:
        with server, server.accept()[0] as conn:
            recv_frame(conn, deadline=time.monotonic() + 10)
            conn.sendall(challenge)
            with contextlib.suppress(EOFError, OSError):
                seen.append(recv_frame(conn, deadline=time.monotonic() + 10)[0])
            seen.append("closed")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server.getsockname(), seen


@pytest.mark.parametrize("challenge,why", [
    (HEADER.pack(CHALLENGE, 64) + os.urandom(64), "did not prove it knows the multi-host secret"),
    (HEADER.pack(HEARTBEAT, 0), "no leader's challenge"),  # an older leader: steps straight away
], ids=["a wrong proof", "no handshake"])
def test_a_follower_leaves_a_step_channel_that_cannot_prove_the_secret(challenge, why):
    address, seen = fake_leader(challenge)
    sock = socket.create_connection(address, timeout=10)
    with sock, pytest.raises(HandshakeError, match=why):
        join(sock, SECRET.encode(), 1, 10.0)
    deadline = time.monotonic() + 10
    while "closed" not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen == ["closed"], f"the follower sends no proof to a leader that proved nothing: {seen}"


def test_a_non_loopback_coordinator_without_a_secret_refuses_to_start(tmp_path):
    remote = dict(coordinator_address="10.1.2.3:9476", num_processes=2, process_id=1)
    with pytest.raises(ValueError, match="EngineConfig.multihost_secret is required"):
        EngineConfig(**remote)
    with pytest.raises(ValueError, match="at least 16 characters.*got 9"):
        EngineConfig(**remote, multihost_secret="tooshort1")
    assert "multihost_secret" not in repr(EngineConfig(**remote, multihost_secret=SECRET)), "never in a repr"
    cmd = [sys.executable, "-m", "api.cli", "serve", "--port", str(free_port()), "--coordinator-address",
           "10.1.2.3:9476", "--num-processes", "2", "--process-id", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode != 0, "a group on a remote coordinator without a secret does not start"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "FERROX_MULTIHOST_SECRET" in lines[0], f"one line saying what to set: {done.stderr}"
    short = subprocess.run([*cmd, "--multihost-secret", "tooshort1"], capture_output=True, text=True, timeout=120,
                           cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert short.returncode != 0 and "at least 16 characters" in short.stderr, short.stderr
    assert "tooshort1" not in short.stderr + short.stdout, "the refused secret is not echoed"


def test_the_generated_loopback_secret_file_is_private_to_the_user(tmp_path):
    directory, address = tmp_path / "secrets", ("127.0.0.1", 9477)
    key, path = publish_loopback_secret(address, str(directory))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, "the secret file is the user's alone"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700, "in a directory only the user can enter"
    assert read_loopback_secret(address, str(directory)) == key and len(key) == 64, "32 random bytes, hex"
    assert publish_loopback_secret(address, str(directory))[0] != key, "each group a fresh secret"
    path.chmod(0o644)
    with pytest.raises(HandshakeError, match="not private to this user"):
        read_loopback_secret(address, str(directory))  # someone else could have read (or written) it
    path.unlink()
    with pytest.raises(HandshakeError, match="--multihost-secret"):
        read_loopback_secret(address, str(directory))


def test_strangers_at_start_up_are_refused_and_the_group_still_forms(tmp_path, tiny_reference):
    """The finding's scenario on a real group: while the leader starts (its channel open, the
    follower still compiling), strangers connect and claim to be follower 1, malformed or
    without the generated secret, and one connects and idles. Every one is refused, and the
    real follower joins and the group serves."""
    seen: dict = {}

    def storm(address: tuple[str, int], procs: list) -> None:
        deadline = time.monotonic() + 600
        while not (hosts := listening_hosts(address[1])):
            assert procs[0].poll() is None and time.monotonic() < deadline, "the leader opens its step channel"
            time.sleep(0.05)
        secret_file = loopback_secret_path(address)
        seen["hosts"] = hosts
        seen["secret_mode"] = stat.S_IMODE(secret_file.stat().st_mode) if secret_file.exists() else None
        seen["idle"] = socket.create_connection(address)
        attempts = {case: functools.partial(stranger, address, raw) for case, (raw, _) in MALFORMED.items()}
        attempts["a wrong secret"] = functools.partial(stranger_with_a_proof, address, b"not the group's secret")
        seen["got"] = {}
        for case, attempt in attempts.items():
            try:
                seen["got"][case] = attempt()
            except ConnectionRefusedError:  # a slot given to a stranger: the leader stopped listening
                seen["got"][case] = ["the channel stopped listening"]
        seen["secret_file"] = secret_file

    with cluster(2, tmp_path, extra=("--multihost-timeout-s", str(TIMEOUT_S)), during_start_up=storm) as (urls, _):
        assert complete_all(urls[0], concurrent=True)[:1] == tiny_reference[:1], "the group forms and serves"
        assert httpx.get(urls[1] + "/health").status_code == 200, "the real follower joined"
    for case, got in seen["got"].items():
        assert set(got) <= {CHALLENGE, REFUSE}, f"{case}: never a step or the welcome: {got}"
    assert seen["hosts"] == ["127.0.0.1"], "the leader's step channel listens on the coordinator's host only"
    assert seen["secret_mode"] == 0o600, "the generated secret is in a file only its user can read"
    assert not seen["secret_file"].exists(), "and that file is gone once the group formed"
    leader_log = (tmp_path / "process-0.log").read_text()
    assert leader_log.count(REFUSED) == len(seen["got"]) + 1, "each stranger (and the idle one) refused in one line"
    assert "Traceback" not in leader_log, "refusals, not exceptions"
