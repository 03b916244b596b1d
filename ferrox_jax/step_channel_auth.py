"""Who may join the multi-host step channel: the group's shared secret, and a mutual
challenge-response handshake (HMAC-SHA256) run on each connection before any step.

The step channel (`ferrox_jax/multihost.py`) sends every step's host batch, users'
prompt tokens included, and a follower slot held by the wrong process stalls the whole
group. So the leader takes a connection as follower i only once it proved it knows the
secret, and a follower sends nothing but its hello before the leader proved it too (a
process squatting the channel's port learns nothing and cannot pose as the leader):

    follower i                                            leader
    O hello   i (u32) | nonce_f (32 random bytes)  --->   i in 1..N and slot i free, else R
              <---  C challenge  nonce_l | HMAC(k, "leader" | i | nonce_f | nonce_l)
    checks the leader's MAC (else it leaves)
    P proof   HMAC(k, "follower" | i | nonce_l | nonce_f)  --->  checked; slot i taken once, else R
              <---  W welcome: steps and heartbeats follow

k is the secret's UTF-8 bytes; MACs are compared with `hmac.compare_digest`. Each side's
nonce is fresh, so a recorded exchange cannot be replayed, and the two directions are
named apart, so one side's answer cannot be reflected back as the other's. Every way a
connection can fail this (a malformed or oversized frame, a wrong MAC, an unknown or taken
slot, an early close, silence past the deadline) is `Refused` with a one-line reason for
the leader's log; no reason holds the secret or a MAC. The handshake authenticates the
ends; it does not encrypt the steps that follow (docs/deploy-tpu.md: keep the coordinator's
ports on a private network).

The secret is `--multihost-secret` (`FERROX_MULTIHOST_SECRET`), the same on every process,
and required when the coordinator is not on loopback (`EngineConfig` refuses to start
without it). A group on one machine that names none gets one from its leader: a random
secret written, before the channel listens, to a file only this user can read
(`loopback_secret_path`: ~/.cache/ferrox_jax/multihost/, directory 0700, file 0600, named
after the channel's address), which its followers read once their connection is accepted
(so never a stale one); the leader removes it once the group has formed. No jax here.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Callable, NoReturn

from ferrox_jax.step_frames import CHALLENGE, HELLO, PROOF, REFUSE, WELCOME, FrameError, recv_frame, send_frame

NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
MIN_SECRET_CHARS = 16  # a shorter --multihost-secret is refused at start-up (EngineConfig)
HELLO_PAYLOAD = struct.Struct(f"!I{NONCE_BYTES}s")  # the follower's process id, its nonce
MAX_REPLY_BYTES = 512  # the largest challenge or refusal a follower reads from a not yet trusted leader
LOOPBACK_SECRET_DIR = os.path.join("~", ".cache", "ferrox_jax", "multihost")
_LEADER, _FOLLOWER = b"ferrox step channel: leader\0", b"ferrox step channel: follower\0"


class Refused(Exception):
    """The leader does not take this connection; the message is why, in one line."""


class HandshakeError(Exception):
    """A follower cannot join: the leader refused it, or the other end is no leader that knows the secret."""


def is_loopback_host(host: str) -> bool:
    """localhost and 127.0.0.0/8 / ::1 literals; no DNS lookup (a name is taken for remote)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def coordinator_host(coordinator_address: str) -> str:
    """"10.0.0.2:9476" -> "10.0.0.2", "[::1]:9476" -> "::1"."""
    return coordinator_address.rpartition(":")[0].strip("[]")


# ---------------------------------------------------------------- the secret


def leader_key(address: tuple[str, int], secret: str | None) -> tuple[bytes, Path | None]:
    """The leader's key, and the loopback secret file it wrote for its followers (None
    when a secret was given).

    Raises:
      ValueError: no secret and the channel is not on loopback, or the secret file's
        directory is not private to this user.
    """
    if secret:
        return secret.encode(), None
    if not is_loopback_host(address[0]):
        raise ValueError(f"the multi-host step channel on {address[0]} needs a shared secret: set "
                         "--multihost-secret (FERROX_MULTIHOST_SECRET) to the same value on every process")
    try:
        return publish_loopback_secret(address)
    except OSError as e:
        raise ValueError(f"cannot write the step channel's secret file under {LOOPBACK_SECRET_DIR}: {e.strerror}; "
                         "give every process the same --multihost-secret (FERROX_MULTIHOST_SECRET) instead") from None


def follower_key(address: tuple[str, int], secret: str | None) -> bytes:
    """The follower's key: the given secret, or on loopback the leader's secret file.

    Raises:
      HandshakeError: none given off loopback, the file is missing or not private.
    """
    if secret:
        return secret.encode()
    if not is_loopback_host(address[0]):
        raise HandshakeError(f"the step channel on {address[0]} needs a shared secret: set --multihost-secret "
                             "(FERROX_MULTIHOST_SECRET) to the leader's value")
    return read_loopback_secret(address)


def loopback_secret_path(address: tuple[str, int], directory: str | None = None) -> Path:
    host = re.sub(r"[^A-Za-z0-9.-]", "_", address[0])
    return Path(os.path.expanduser(directory or LOOPBACK_SECRET_DIR)) / f"step-channel-{host}-{address[1]}.secret"


def publish_loopback_secret(address: tuple[str, int], directory: str | None = None) -> tuple[bytes, Path]:
    """A fresh random secret in a file only this user can read: created 0600 under another
    name in a 0700 directory of this user's, then renamed into place, so no reader ever
    sees it half written or with wider permissions. Returns (the key, the file)."""
    path = loopback_secret_path(address, directory)
    _private_directory(path.parent)
    secret = secrets.token_hex(32)
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.unlink(missing_ok=True)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    os.replace(part, path)
    return secret.encode(), path


def read_loopback_secret(address: tuple[str, int], directory: str | None = None) -> bytes:
    """The secret a loopback leader published; refused unless the file and its directory
    are this user's and closed to everyone else (a file someone else could have written
    would let them pose as the leader)."""
    path = loopback_secret_path(address, directory)
    try:
        if not _is_private(os.lstat(path.parent), stat.S_ISDIR):
            raise HandshakeError(f"the secret directory {path.parent} is not private to this user (owner, "
                                 "mode 0700): fix or remove it and restart the group")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise HandshakeError(f"no --multihost-secret given and no leader's secret file {path}: give every process "
                             "the same --multihost-secret (FERROX_MULTIHOST_SECRET), or run the whole group as one "
                             "user on one machine") from None
    except OSError as e:
        raise HandshakeError(f"cannot read the leader's secret file {path}: {e.strerror}") from None
    with os.fdopen(fd) as f:
        if not _is_private(os.fstat(f.fileno()), stat.S_ISREG):
            raise HandshakeError(f"the secret file {path} is not private to this user (owner, mode 0600): "
                                 "remove it and restart the group")
        return f.read().strip().encode()


def _is_private(st: os.stat_result, is_kind: Callable[[int], bool]) -> bool:
    return is_kind(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _private_directory(directory: Path) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ValueError(f"the step channel's secret directory {directory} is not a directory owned by this user: "
                         "remove it, or give every process --multihost-secret")
    if st.st_mode & 0o077:  # ours, but opened up: close it before a secret goes in
        os.chmod(directory, 0o700)


# ---------------------------------------------------------------- the handshake


def _mac(key: bytes, direction: bytes, process_id: int, first_nonce: bytes, second_nonce: bytes) -> bytes:
    return hmac.new(key, direction + struct.pack("!I", process_id) + first_nonce + second_nonce,
                    hashlib.sha256).digest()


def refuse(conn: socket.socket, reason: str) -> NoReturn:
    """Tells the peer why (when it still listens) and raises Refused(reason)."""
    with contextlib.suppress(OSError):
        send_frame(conn, REFUSE, reason.encode())
    raise Refused(reason)


def answer(conn: socket.socket, key: bytes, num_followers: int, is_taken: Callable[[int], bool],
           timeout_s: float) -> int:
    """The leader's half, up to the follower's proof: returns the process id of a peer that
    proved it knows the secret (the caller takes the slot, once, and welcomes it). The
    whole exchange has `timeout_s`, however slowly the peer trickles its bytes.

    Raises:
      Refused: with the reason, for every way the peer can fail it.
    """
    deadline = time.monotonic() + timeout_s
    try:
        kind, payload = recv_frame(conn, HELLO_PAYLOAD.size, deadline)
        if kind != HELLO or len(payload) != HELLO_PAYLOAD.size:
            raise Refused(f"not a follower's hello (a {kind!r} frame of {len(payload)} bytes)")
        process_id, follower_nonce = HELLO_PAYLOAD.unpack(payload)
        if not 1 <= process_id <= num_followers:
            refuse(conn, f"follower id {process_id} is not one of this group's (1..{num_followers})")
        if is_taken(process_id):
            refuse(conn, f"follower slot {process_id} is already taken")
        leader_nonce = secrets.token_bytes(NONCE_BYTES)
        send_frame(conn, CHALLENGE, leader_nonce + _mac(key, _LEADER, process_id, follower_nonce, leader_nonce))
        kind, proof = recv_frame(conn, MAC_BYTES, deadline)
        expected = _mac(key, _FOLLOWER, process_id, leader_nonce, follower_nonce)
        if kind != PROOF or not hmac.compare_digest(proof, expected):
            refuse(conn, f"a hello as follower {process_id} did not prove it knows the multi-host secret")
        return process_id
    except EOFError:
        raise Refused("closed the connection before finishing the handshake") from None
    except TimeoutError:
        raise Refused(f"did not finish the handshake within {timeout_s:g} s") from None
    except FrameError as e:
        raise Refused(str(e)) from None
    except OSError as e:
        raise Refused(f"connection error during the handshake: {e.strerror or type(e).__name__}") from None


def join(sock: socket.socket, key: bytes, process_id: int, timeout_s: float) -> None:
    """The follower's half: returns once the leader proved the secret and welcomed this
    follower as `process_id`.

    Raises:
      HandshakeError: refused by the leader, or the other end did not prove the secret.
    """
    deadline = time.monotonic() + timeout_s
    follower_nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        send_frame(sock, HELLO, HELLO_PAYLOAD.pack(process_id, follower_nonce))
        kind, payload = recv_frame(sock, MAX_REPLY_BYTES, deadline)
        _raise_if_refused(kind, payload)
        if kind != CHALLENGE or len(payload) != NONCE_BYTES + MAC_BYTES:
            raise HandshakeError("the step channel's address answered with no leader's challenge: is another "
                                 "program listening on the coordinator's port + 1?")
        leader_nonce, mac = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
        if not hmac.compare_digest(mac, _mac(key, _LEADER, process_id, follower_nonce, leader_nonce)):
            raise HandshakeError("the process at the step channel's address did not prove it knows the multi-host "
                                 "secret: give every process the same --multihost-secret (FERROX_MULTIHOST_SECRET)")
        send_frame(sock, PROOF, _mac(key, _FOLLOWER, process_id, leader_nonce, follower_nonce))
        kind, payload = recv_frame(sock, MAX_REPLY_BYTES, deadline)
        _raise_if_refused(kind, payload)
        if kind != WELCOME:
            raise HandshakeError(f"the leader answered the proof with a {kind!r} frame, not its welcome")
    except EOFError:
        raise HandshakeError("the leader closed the connection during the handshake") from None
    except TimeoutError:
        raise HandshakeError(f"the leader did not finish the handshake within {timeout_s:g} s") from None
    except (FrameError, OSError) as e:
        raise HandshakeError(f"the step channel broke during the handshake: {e}") from None


def _raise_if_refused(kind: bytes, payload: bytes) -> None:
    if kind == REFUSE:  # the text of a peer not yet trusted: printable characters only into the log
        reason = "".join(c if c.isprintable() else "?" for c in payload.decode("utf-8", "replace"))
        raise HandshakeError(f"the leader refused this follower: {reason}")
