"""One NIXL peer's record on our side, and the parse of its handshake frame.

The frame is parsed whole, and checked, before any of it touches a NIXL agent: a malformed
one is a :class:`~xavier_async.errors.HandshakeError` and changes nothing.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from typing import Any

from ..errors import HandshakeError
from .base import Regions
from .handshake import FrameStream
from .nixl_copies import _Mapping


def parse_peer_frame(frame: dict[str, Any]) -> tuple[dict[str, Any], int, bytes, dict[int, int],
                                                     int, str, str | None]:
    """``(hello, rank, agent metadata, receive slabs' addresses, receive device, memory kind,
    bulk agent's name)`` from a peer's handshake frame; raises ``HandshakeError``."""
    try:  # parse everything before touching the agent
        rank = frame["hello"]["rank"]
        meta = base64.b64decode(frame["meta"], validate=True)
        recv_ptr, recv_dev = int(frame["recv_ptr"]), int(frame.get("recv_dev", 0))
        recv_ptrs = {int(i): int(p) for i, p in dict(frame.get("recv_slabs", {})).items()}
        recv_ptrs.setdefault(0, recv_ptr)
        mem = str(frame.get("mem", "DRAM"))
        bulk_agent = frame.get("bulk_agent")
    except (KeyError, TypeError, ValueError) as exc:
        raise HandshakeError(f"malformed handshake from peer: {exc!r}") from None
    if type(rank) is not int or rank < 0 or mem not in ("DRAM", "VRAM") \
            or not (bulk_agent is None or (isinstance(bulk_agent, str) and bulk_agent)):
        raise HandshakeError(f"malformed handshake from peer (rank {rank!r}, memory {mem!r}, "
                             f"bulk agent {bulk_agent!r})")
    return frame["hello"], rank, meta, recv_ptrs, recv_dev, mem, bulk_agent


class _Peer:
    """What we know of one connected peer: its agents' names, the receive slabs we may write,
    the handles made for it, and whether it is lost."""

    __slots__ = ("rank", "agent", "recv_ptrs", "recv_dev", "mem", "fs", "lost", "handles", "hello",
                 "joined", "told", "direct", "bulk_agent")

    def __init__(self, rank: int, agent: str, recv_ptrs: dict[int, int], recv_dev: int, mem: str,
                 fs: FrameStream, hello: dict[str, Any], told: set[int]) -> None:
        self.rank, self.agent, self.recv_dev, self.mem = rank, agent, recv_dev, mem
        #: the peer's receive slabs we may write: index -> address
        self.recv_ptrs = recv_ptrs
        self.fs = fs
        self.hello = hello
        self.lost = False
        self.joined = False
        #: (our send slab, view bytes, the peer's receive slab) -> _Mapping
        self.handles: dict[tuple[int, int, int], _Mapping] = {}
        #: our receive slabs this peer knows (their registrations reached its agent)
        self.told = told
        #: (its receive slab, regions of our pools) -> transfer handle, least recently
        #: used first (writes straight from a snapshot tier)
        self.direct: OrderedDict[tuple[int, Regions, bool], Any] = OrderedDict()
        #: the name of the peer's bulk agent (its large WRITEs' notifications), if any
        self.bulk_agent: str | None = None

    @property
    def recv_ptr(self) -> int:
        return self.recv_ptrs[0]

    def agents(self) -> tuple[str, ...]:
        """The names its notifications come under: its agent's, and its bulk agent's."""
        return (self.agent,) if self.bulk_agent is None else (self.agent, self.bulk_agent)
