"""Multipart messages in and out of a ZeroMQ socket, for the control path's every call.

pyzmq's `send_multipart` ORs its flags as enum members for every frame and `recv_multipart` asks
the socket for ZMQ_RCVMORE through an enum after every frame: a few microseconds a message that a
one-key lookup pays four times (the client's send and receive, the daemon's), on top of its own work.
These send with plain int flags and read "more" off each received frame. Same semantics: a message
is delivered whole or not at all, so only the first frame can wait or raise zmq.Again.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence

import zmq

NOBLOCK = int(zmq.NOBLOCK)
# A socket monitor's events for a handshake that failed (CURVE: a wrong key, or a peer without it).
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MORE = int(zmq.SNDMORE)


def send_frames(sock: zmq.Socket, frames: Sequence[bytes], flags: int = 0, copy: bool = True) -> None:
    """`sock.send_multipart(frames, flags, copy=copy)`: every frame but the last with SNDMORE. The
    frames are bytes (what protocol.py encodes): unlike send_multipart, nothing checks beforehand
    that each one can be sent, and a frame that could not would leave the message half sent."""
    send, more = sock.send, flags | _MORE
    for frame in frames[:-1]:
        send(frame, more, copy=copy)
    send(frames[-1], flags, copy=copy)


def recv_frames(sock: zmq.Socket, flags: int = 0, most: int | None = None) -> list[bytes]:
    """`sock.recv_multipart(flags, copy=True)`: the message's frames as bytes (zmq.Again when
    `flags` has NOBLOCK and none is queued, or when the socket's RCVTIMEO passes). Frames past the
    first `most` are received but not kept: one b"" stands for them all (more than `most`, for the
    caller to refuse the message by; a b"" each held 8 bytes a frame, 64 MB for a message of 8
    million empty frames, a review)."""
    recv = sock.recv
    frame = recv(flags, copy=False)
    parts = [frame.bytes]
    while frame.more:
        frame = recv(flags, copy=False)
        if most is None or len(parts) < most:
            parts.append(frame.bytes)
        elif len(parts) == most:
            parts.append(b"")
    return parts


def descriptors_left() -> tuple[int, int] | None:
    """(descriptors this process may still open, its soft limit); None when it has no limit, or its
    open descriptors cannot be counted (no /proc). libzmq aborts the whole process when it finds no
    descriptor for one it must make (its I/O thread's, an ipc accept's): the daemon's attach and the
    client's connect ask this first."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        return soft - len(os.listdir("/proc/self/fd")), soft
    except OSError:
        return None
