"""One peer channel: the state machine, the view mappings and the copy dispatch.

A channel belongs to the endpoint that *writes* (the source of a load) and one peer rank.
It has exactly one state machine, whatever the number of copies in flight: its input is
the sequence of batches in the order the source *commits* them (:meth:`PeerChannel.commit`,
called right before the copy is posted, with nothing awaited between the decision and the
commit), which with several copies in flight need not be the order they arrived in.
A mapping is per (send slab, send view, peer's receive slab): two copies in flight never
share one, because each holds its send slab and its receive slab until it is terminal.
Mapping registration is single-flight: concurrent callers wait on one lock and see the
result of the registration in progress; a failure is retried with backoff per the
:class:`RetryPolicy` and never cached. A transport failure resets the channel: state back
to ``full``, every mapping dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from .errors import (InternalError, InvalidRequestError, PeerLostError, RegistrationError,
                     TransferError)
from .layout import align_up
from .metrics import PeerMetrics
from .policy import ChannelPolicy
from .retry import RetryPolicy
from .shielded import wait_terminal
from .sizes import SMALL, View
from .slabs import Slab
from .transports.base import Regions, Transport


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """What one write will do: through which view, how many bytes on the wire."""

    payload: int
    view: View
    view_bytes: int
    wire_bytes: int
    mapping: object
    #: block bytes in the payload (the payload minus alignment gaps between segments)
    useful: int
    #: the peer's receive slab the mapping writes into (the reply names it)
    slab: int = 0


class PeerChannel:
    """The writer's side of one (endpoint, peer) pair."""

    def __init__(self, peer: int, transport: Transport, send_slabs: Sequence[Slab],
                 policy: ChannelPolicy, retry: RetryPolicy, metrics: PeerMetrics, *,
                 trimmed: bool, trim_align: int) -> None:
        self.peer = peer
        self.transport = transport
        self.send_slabs = list(send_slabs)
        self.policy = policy
        self.retry = retry
        self.metrics = metrics
        self.trimmed = trimmed
        self.trim_align = trim_align
        #: per send slab: (send view, peer's receive slab) -> the transport's mapping
        self._mappings: list[dict[tuple[View, int], object]] = [{} for _ in self.send_slabs]
        self._map_lock = anyio.Lock(fast_acquire=True)
        self._last_view: View | None = None

    @property
    def mapped(self) -> dict[tuple[int, View, int], object]:
        """The (send slab, view name, peer's receive slab) triples mapped for this peer and
        their transport mappings."""
        return {(s, v, r): m for s, by in enumerate(self._mappings) for (v, r), m in by.items()}

    def mapped_for(self, send: int) -> dict[tuple[View, int], object]:
        """The (view name, peer's receive slab) pairs mapped from send slab ``send`` (what
        :func:`xavier_async.decision.decide` is given)."""
        return self._mappings[send]

    async def mapping(self, name: View, slab: int = 0, send: int = 0) -> object:
        """The mapping of view ``name`` of send slab ``send`` to the peer's receive slab
        ``slab``, registering it on first use (single flight, retried)."""
        key = (name, slab)
        by = self._mappings[send]
        m = by.get(key)
        if m is not None:
            return m
        view = self.send_slabs[send][name]
        async with self._map_lock:
            m = by.get(key)
            if m is not None:
                return m
            delays = self.retry.delays()
            while True:
                try:
                    m = await self.transport.map_view(self.peer, view, slab)
                except (PeerLostError, InvalidRequestError):
                    self.metrics.failures += 1
                    raise
                except Exception as exc:  # transport-specific failures are retried
                    delay = next(delays, None)
                    if delay is None:
                        self.metrics.failures += 1
                        raise RegistrationError(
                            f"mapping {view} for rank {self.peer} failed after "
                            f"{self.retry.attempts} attempt(s): {exc}") from exc
                    self.metrics.retries += 1
                    await anyio.sleep(delay)
                else:
                    by[key] = m
                    self.metrics.registrations += 1
                    return m

    def commit(self, payload: int, view: View, useful: int, slab: int = 0, send: int = 0) -> CopyPlan:
        """Advance the machine for a batch whose view (``view``, mapped from send slab
        ``send`` to the peer's receive slab ``slab``, just decided by peeking at the
        machine) is about to be written; nothing may be awaited between that decision and
        this call. The order of these calls is the machine's input."""
        chosen = self.policy.commit(payload)
        if chosen != view:
            raise InternalError(f"the channel machine chose the {chosen} view, the decision "
                                f"was {view} (something advanced it in between)")
        view_bytes = self.policy.sizes.nbytes(view)
        wire = min(view_bytes, align_up(payload, self.trim_align)) if self.trimmed else view_bytes
        return CopyPlan(payload, view, view_bytes, wire, self._mappings[send][(view, slab)], useful,
                        slab)

    def post(self, plan: CopyPlan, notify: bytes | None) -> object | None:
        """Start the copy (synchronous). ``None`` if it already finished (metrics are
        counted), else a token for :meth:`finish`. On failure the channel is reset (the
        caller must then call the transport's ``forget``) and :class:`TransferError` is
        raised."""
        try:
            pending = self.transport.post(self.peer, plan.mapping, plan.wire_bytes, notify)
        except Exception as exc:
            raise self._failed(exc) from exc
        if pending is None:
            self._account(plan)
        return pending

    def post_regions(self, plan: CopyPlan, regions: Regions,
                     notify: bytes | None) -> object | None:
        """Start a WRITE straight from a registered pool (the snapshot store) into the
        plan's receive slab: ``regions`` of ``(address, offset in the slab, bytes)``; the
        plan's wire bytes are the regions' (what moves). As :meth:`post` otherwise."""
        try:
            pending = self.transport.post_regions(self.peer, regions, plan.slab, notify)
        except Exception as exc:
            raise self._failed(exc) from exc
        if pending is None:
            self._account(plan)
        return pending

    async def finish(self, plan: CopyPlan, pending: object) -> None:
        """Wait, shielded, until a posted copy is terminal; count it, or reset and raise."""
        try:
            held = await wait_terminal(lambda: self.transport.wait(pending))
        except Exception as exc:
            err = self._failed(exc)
            await self.forget()
            raise err from exc
        self._account(plan)
        if held is not None:
            raise held

    def _failed(self, exc: BaseException) -> TransferError:
        self.metrics.failures += 1
        self.reset_now()
        if isinstance(exc, TransferError):
            return exc
        return TransferError(f"copy to rank {self.peer} failed: {exc}")

    def _account(self, plan: CopyPlan) -> None:
        m = self.metrics
        m.batches_sent += 1
        m.useful_bytes += plan.useful
        m.wire_bytes += plan.wire_bytes
        if plan.view == SMALL:
            m.copies_small += 1
        else:
            m.copies_full += 1
        if self._last_view is not None and self._last_view != plan.view:
            m.view_switches += 1
        self._last_view = plan.view

    def reset_now(self) -> None:
        """Back to ``full`` with no mappings (after a transport failure or a lost peer);
        the transport's own mappings are dropped by :meth:`forget`."""
        self.policy.reset()
        for by in self._mappings:
            by.clear()
        self._last_view = None
        self.metrics.resets += 1

    async def forget(self) -> None:
        """Drop the transport's mappings for this peer (shielded, errors ignored)."""
        with anyio.CancelScope(shield=True):
            try:
                await self.transport.forget(self.peer)
            except Exception:  # the peer may be gone already; our mappings are dropped
                pass

    async def reset(self) -> None:
        """:meth:`reset_now` then :meth:`forget`."""
        self.reset_now()
        await self.forget()
