"""The multi-host step channel's wire format: length-prefixed frames over TCP.

A frame is a 9-byte header, its kind (one byte) and its payload's length (unsigned 64-bit,
network order), then the payload. The kinds, and who sends them:

    handshake (ferrox_jax/step_channel_auth.py)      steps (ferrox_jax/multihost.py)
    O  hello       follower -> leader                B  a step's host batch     leader -> follower
    C  challenge   leader -> follower                M  the step's bitmask      leader -> follower
    P  proof       follower -> leader                D  a draft proposal step   leader -> follower
    W  welcome     leader -> follower                S  stop                    leader -> follower
    R  refusal     leader -> follower                H  heartbeat               both ways

A reader names the largest payload it accepts (`max_bytes`): before a peer has proved it
knows the group's secret, a length prefix of 2**63 is a refusal, not an allocation.
No jax here.
"""

from __future__ import annotations

import socket
import struct
import time

HEADER = struct.Struct("!cQ")  # frame kind, payload bytes
BATCH, MASK, STOP, HEARTBEAT, DRAFT = b"B", b"M", b"S", b"H", b"D"
HELLO, CHALLENGE, PROOF, WELCOME, REFUSE = b"O", b"C", b"P", b"W", b"R"


class FrameError(ValueError):
    """A frame this reader does not take (a length above its `max_bytes`)."""


def send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    sock.sendall(HEADER.pack(kind, len(payload)) + payload)


def recv_frame(sock: socket.socket, max_bytes: int | None = None,
               deadline: float | None = None) -> tuple[bytes, bytes]:
    """The next frame as (kind, payload).

    Args:
      max_bytes: the largest payload taken; a longer length prefix raises FrameError
        before anything of the payload is read. None: any (a peer already trusted).
      deadline: a `time.monotonic()` time by which the whole frame must have arrived (a
        peer that trickles a byte at a time cannot hold the reader past it); None: each
        read waits for the socket's own timeout.

    Raises:
      EOFError (the peer closed), TimeoutError, OSError, FrameError.
    """
    kind, size = HEADER.unpack(_recv_exact(sock, HEADER.size, deadline))
    if max_bytes is not None and size > max_bytes:
        raise FrameError(f"a frame of {size} bytes where at most {max_bytes} are taken")
    return kind, _recv_exact(sock, size, deadline) if size else b""


def _recv_exact(sock: socket.socket, num_bytes: int, deadline: float | None) -> bytes:
    chunks, left = [], num_bytes
    while left:
        if deadline is not None:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError("the frame did not arrive in time")
            sock.settimeout(remaining_s)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
