"""Bare channel copies for the benchmark: the seed's four cases are about the channel (which
view, how many registrations), so they are measured without the load protocol around them.

A raw copy writes the first ``nbytes`` of the send slab into the peer's receive slab
through the view the channel's machine chooses, with no request and no unpack. It
overwrites the peer's receive slab without coordination, so the peer must consent
(:func:`accept_raw_copies` before it starts; its hello says so) and must load nothing
meanwhile. None of this is part of the engine's API: it goes through the engine's
internal seams (:mod:`xavier_async._internal`) on purpose.
"""

from __future__ import annotations

import anyio

from .. import _internal
from .._checks import check_bool, check_size
from ..channel import PeerChannel
from ..endpoint import Endpoint
from ..errors import InvalidRequestError
from ..policy import ChannelPolicy

#: the hello field by which an endpoint consents to raw copies into its receive slab
RAW_COPIES = "accept_raw_copies"


def accept_raw_copies(ep: Endpoint) -> None:
    """Let peers :func:`copy_raw` into ``ep``'s receive slab (call before entering ``ep``)."""
    _internal.hello_extras(ep)[RAW_COPIES] = True


async def copy_raw(ep: Endpoint, peer: int, nbytes: int) -> int:
    """One bare copy of ``nbytes`` to ``peer`` through the view the machine picks; returns
    that view's size. Cancellation behaves as for a load: a started copy is waited for."""
    check_size("nbytes", nbytes)
    ch = ep.channel(peer)
    if not ep.peer_hello(peer).get(RAW_COPIES):
        raise InvalidRequestError(f"rank {peer} does not accept raw copies")
    if nbytes > ep.config.full_bytes:
        raise InvalidRequestError(f"{nbytes} B exceeds the full slab ({ep.config.full_bytes} B)")
    async with _internal.holding_send_slab(ep):
        plan = await _internal.prepare_bare_copy(ch, nbytes)
        await _internal.write_bare_copy(ch, plan)
    # a cancellation that arrived during the (shielded) copy surfaces now
    await anyio.lowlevel.checkpoint_if_cancelled()
    return plan.view_bytes


def tune_channel(ep: Endpoint, peer: int, *, streak: int | None = None,
                 trimmed: bool | None = None) -> PeerChannel:
    """Change one peer's streak length and/or trimmed mode (the machine restarts in
    ``full``; mappings are kept). Other peers keep the endpoint's config."""
    ch = ep.channel(peer)
    if streak is not None:
        p = ch.policy
        ch.policy = ChannelPolicy(p.full_bytes, p.small_bytes, streak)
    if trimmed is not None:
        ch.trimmed = check_bool("trimmed", trimmed)
    ch.policy.reset()
    return ch


def raw_floor(ep: Endpoint, peer: int, nbytes: int, copies: int, warmup: int = 10) -> list[float]:
    """The raw NIXL floor to ``peer`` on ``ep``'s own registrations: one transfer handle
    made once and re-posted, completion busy-polled, no event loop, no notification.
    Returns per-copy seconds. Writes scratch bytes into the peer's receive slab: only while
    the peer loads nothing (as the benchmark does)."""
    import time

    from ..errors import TransferError

    agent, h = _internal.raw_handle(ep, peer, nbytes)
    perf = time.perf_counter
    out = []
    try:
        for i in range(warmup + copies):
            t0 = perf()
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise TransferError(f"raw floor copy failed: {state}")
            if i >= warmup:
                out.append(perf() - t0)
    finally:
        agent.release_xfer_handle(h)
    return out
