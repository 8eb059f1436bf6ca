"""Internal seams for the benchmark and the test support: NOT public API, no stability
promise between releases. The engine never imports this module.

The benchmark measures bare channel copies (the seed's four cases are about the channel:
which view, how many registrations), the raw NIXL floor on the endpoint's own
registrations, and hello extras by which a peer consents to bare copies. Each reaches
into the engine at one place, here, instead of through attributes on the public classes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from .channel import CopyPlan, PeerChannel
from .errors import InvalidRequestError, TransferError

if TYPE_CHECKING:
    from .endpoint import Endpoint
    from .slabs import Slab


def hello_extras(ep: Endpoint) -> dict[str, Any]:
    """The optional fields ``ep``'s hello carries to its peers (uninterpreted by the
    engine; set them before ``ep`` starts)."""
    return ep._hello_extras


@asynccontextmanager
async def holding_send_slab(ep: Endpoint, index: int = 0) -> AsyncIterator[Slab]:
    """Hold send slab ``index`` of ``ep`` (counted as work in flight, so close waits for
    it), for a copy outside the serve path."""
    async with ep._source.holding_send_slab(index) as slab:
        yield slab


def mapped_views(ch: PeerChannel) -> tuple[int, ...]:
    """Sizes of the views mapped for ``ch``'s peer (from any send slab, to any of its
    receive slabs)."""
    first = ch.send_slabs[0]
    return tuple(sorted({first[view].nbytes for (_, view, _) in ch.mapped}))


async def prepare_bare_copy(ch: PeerChannel, payload: int) -> CopyPlan:
    """Choose the view for a bare copy of ``payload`` bytes from send slab 0 to the peer's
    receive slab 0, make sure it is mapped, then commit the choice. The machine only
    advances once the mapping exists, so a failed registration leaves the channel's state
    as it was (and a reset during the registration is honoured: the choice is made again
    afterwards)."""
    if not 0 < payload <= ch.policy.full_bytes:
        ch.policy.select(payload)  # raises the policy's own error
    while True:
        view = ch.policy.peek_view(payload)
        if (view, 0) in ch.mapped_for(0):
            return ch.commit(payload, view, payload)
        await ch.mapping(view)


async def write_bare_copy(ch: PeerChannel, plan: CopyPlan) -> None:
    """Start the copy and wait, shielded, for its terminal state."""
    try:
        pending = ch.post(plan, None)
    except TransferError:
        await ch.forget()
        raise
    if pending is not None:  # not finished while posting
        await ch.finish(plan, pending)


def raw_handle(ep: Endpoint, peer: int, nbytes: int) -> tuple[Any, Any]:
    """``(agent, handle)``: a NIXL WRITE of the first ``nbytes`` of ``ep``'s first send
    slab into ``peer``'s first receive slab, made once (the raw floor re-posts it). The
    caller releases the handle with ``agent.release_xfer_handle``."""
    t = ep.transport
    agent = getattr(t, "agent", None)
    slab = ep.send_slab
    if agent is None or slab is None:
        raise InvalidRequestError("the raw floor needs a started NIXL transport")
    p = t._peer(peer)  # type: ignore[attr-defined]
    # a handle of the copy path's own making (transports/nixl_copies.py), never cached there
    return agent, t._copies.handle(p, slab.tensor.data_ptr(), nbytes)  # type: ignore[attr-defined]


__all__ = ["hello_extras", "holding_send_slab", "mapped_views", "prepare_bare_copy",
           "write_bare_copy", "raw_handle"]
