"""The source's serve decision (pure: no I/O, no event loop, no transport).

:func:`parse_load` turns a request into segments once, checked against the source's
layout; :func:`decide` answers, as often as asked, whether it can be served now
(:class:`Ready`), needs a view mapped first (:class:`NeedsMapping`) or must be refused
(:class:`Refuse`). Everything here can be fed arbitrary requests: malformed ones become a
:class:`Refuse`.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Union

from .errors import InvalidRequestError, StaleRequestError, XavierError
from .layout import BlockKey, CacheLayout, LayerId
from .planning import Segment, segments_from_wire
from .policy import ChannelPolicy
from .protocol import Load, Probe
from .sizes import View


@dataclass(frozen=True, slots=True)
class ParsedLoad:
    """A request checked against the source's layout: its segments and payload."""

    req_id: int
    segments: list[Segment]
    payload: int
    useful: int
    epoch: int = 0
    slab: int = 0
    verify: bool = False


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer the request with an :class:`Error`."""

    req_id: int
    error: XavierError


@dataclass(frozen=True, slots=True)
class NeedsMapping:
    """The view the channel's machine picks is not mapped to the request's receive slab
    yet: map it, then decide again."""

    view: View
    slab: int = 0


@dataclass(frozen=True, slots=True)
class Ready:
    """Serve now: pack ``slot_lists`` into the send slab and write through ``view``."""

    load: ParsedLoad
    slot_lists: list[Sequence[int]]
    view: View

    @property
    def target(self) -> tuple[View, int]:
        """The mapping this copy uses: (send view, receiver's receive slab)."""
        return (self.view, self.load.slab)


Decision = Union[Refuse, NeedsMapping, Ready]


def parse_load(load: Load, layout: CacheLayout, full_bytes: int) -> ParsedLoad | Refuse:
    """Rebuild a request's segments (same offsets as the receiver computed)."""
    try:
        segments, payload = segments_from_wire(load.batch, layout)
    except InvalidRequestError as exc:
        return Refuse(load.req_id, exc)
    except (TypeError, ValueError) as exc:  # a malformed request from the peer
        return Refuse(load.req_id, InvalidRequestError(f"malformed load request: {exc}"))
    if payload > full_bytes:
        return Refuse(load.req_id, InvalidRequestError(f"batch of {payload} B exceeds the full slab"))
    if payload <= 0:
        return Refuse(load.req_id, InvalidRequestError("empty load request"))
    return ParsedLoad(load.req_id, segments, payload, sum(s.nbytes for s in segments),
                      load.epoch, load.slab, load.verify)


def check_probe(probe: Probe, layout: CacheLayout,
                published: Mapping[LayerId, Mapping[BlockKey, int]]) -> XavierError | None:
    """``None`` if every key ``probe`` names is published here, else the refusal."""
    try:
        segments, _ = segments_from_wire(probe.batch, layout)
    except InvalidRequestError as exc:
        return exc
    except (TypeError, ValueError) as exc:
        return InvalidRequestError(f"malformed probe: {exc}")
    refused = slots_of(ParsedLoad(probe.req_id, segments, 0, 0), published)
    return refused.error if isinstance(refused, Refuse) else None


def check_epoch(req_id: int, epoch: int, min_epoch: int) -> Refuse | None:
    """A request from an epoch older than the pair's current one is refused (its
    receiver has moved on: it gave up on it, or reconnected since)."""
    if epoch < min_epoch:
        return Refuse(req_id, StaleRequestError(
            f"request {req_id} is from epoch {epoch}, the connection is at epoch {min_epoch}: "
            "its receiver has moved on"))
    return None


def _no_slots(table: Mapping[BlockKey, int]) -> tuple[int, ...]:
    return ()


def _getter(keys: tuple[BlockKey, ...]) -> Callable[[Mapping[BlockKey, int]], Any]:
    """``table -> the slots of keys`` (a sequence, also for one key or none)."""
    if len(keys) > 1:
        return itemgetter(*keys)
    if keys:
        key = keys[0]
        return lambda table: (table[key],)
    return _no_slots


def slots_of(load: ParsedLoad, published: Mapping[LayerId, Mapping[BlockKey, int]],
             ) -> list[Sequence[int]] | Refuse:
    """Source slots of every segment's keys, or a refusal naming the unpublished ones."""
    slot_lists: list[Sequence[int]] = []
    keys: tuple[BlockKey, ...] | None = None
    get: Callable[[Mapping[BlockKey, int]], Any] = _no_slots
    for seg in load.segments:
        table = published.get(seg.layer, {})
        if seg.keys is not keys:  # (segments that repeat the previous keys share them)
            keys = seg.keys
            get = _getter(keys)
        try:
            slot_lists.append(get(table))  # one C call for every key of the segment
        except (KeyError, TypeError):  # unknown or unhashable keys
            missing = [k for k in seg.keys if not isinstance(k, (int, str, bytes)) or k not in table]
            return Refuse(load.req_id, InvalidRequestError(
                f"block key(s) {missing[:4]!r} not published in layer {seg.layer!r}"))
    return slot_lists


def decide(load: ParsedLoad, published: Mapping[LayerId, Mapping[BlockKey, int]],
           policy: ChannelPolicy, mapped: Container[tuple[View, int]]) -> Decision:
    """Whether ``load`` can be served now. Pure: the machine is only peeked at; the caller
    commits the choice when it posts the copy, with nothing awaited in between.
    ``mapped`` holds the (view, receive slab) pairs the channel has mappings for."""
    slots = slots_of(load, published)
    if isinstance(slots, Refuse):
        return slots
    view = policy.peek_view(load.payload)
    if (view, load.slab) not in mapped:
        return NeedsMapping(view, load.slab)
    return Ready(load, slots, view)


__all__ = ["ParsedLoad", "Refuse", "NeedsMapping", "Ready", "Decision", "parse_load",
           "check_probe", "check_epoch", "slots_of", "decide"]
