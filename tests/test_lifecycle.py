"""The endpoint's lifecycle (:mod:`xavier_async.lifecycle`): the table is read off the
`transitions` machine, only its transitions are taken, and the one guard says why work is
refused; an endpoint walks it through ``async with`` and ``aclose``."""

from __future__ import annotations

import pytest
import torch

from xavier_async import Endpoint, EndpointClosedError, InternalError, LocalTransport
from xavier_async.lifecycle import (CLOSE, CLOSED, START, START_FAILED, STARTED, TRANSITIONS,
                                    Lifecycle, Phase, build_lifecycle, lifecycle_table)

from .conftest import lifecycle_phase


def test_the_table_is_the_machine():
    machine = build_lifecycle()
    assert {p.value for p in Phase} == set(machine.states)
    assert lifecycle_table() == {(s, e): d for s, e, d in TRANSITIONS}


def test_only_its_transitions_are_taken():
    life = Lifecycle()
    with pytest.raises(InternalError, match="cannot 'closed' while new"):
        life.fire(CLOSED)
    assert [life.fire(e) for e in (START, STARTED, CLOSE, CLOSED)] == \
        [Phase.STARTING, Phase.OPEN, Phase.CLOSING, Phase.CLOSED]
    with pytest.raises(InternalError):
        life.fire(START)                     # a closed endpoint never starts again
    failed = Lifecycle()
    failed.fire(START)
    assert failed.fire(START_FAILED) is Phase.CLOSED


@pytest.mark.parametrize("events,message", [((), "use `async with"), ((START,), "not open yet"),
                                            ((START, STARTED, CLOSE), "closed")])
def test_the_one_guard_says_why(events, message):
    life = Lifecycle()
    for e in events:
        life.fire(e)
    with pytest.raises(EndpointClosedError, match=message):
        life.check_open()


@pytest.mark.anyio
async def test_an_endpoint_walks_the_lifecycle():
    ep = Endpoint(0, {0: torch.zeros(4, 8)}, LocalTransport())
    assert lifecycle_phase(ep) is Phase.NEW and not ep.closed
    async with ep:
        assert lifecycle_phase(ep) is Phase.OPEN
    assert lifecycle_phase(ep) is Phase.CLOSED and ep.closed
    await ep.aclose()                        # idempotent
    with pytest.raises(EndpointClosedError, match="entered once"):
        await ep.__aenter__()
    never = Endpoint(1, {0: torch.zeros(4, 8)}, LocalTransport())
    await never.aclose()                     # closed before it was entered
    assert lifecycle_phase(never) is Phase.CLOSED
