"""Malformed arguments to publish, unpublish, connect and disconnect raise library errors
before anything happens, never a bare builtin (issue 21, finding 6): hypothesis throws
arbitrary junk at them and only :class:`XavierError` subclasses may come out; a refused
publish publishes nothing."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xavier_async import (Endpoint, EndpointConfig, HandshakeError, InvalidRequestError,
                          LocalFabric, XavierError)
from xavier_async.transports.nixl import NixlTransport, parse_address  # both import without NIXL

from .conftest import requires_nixl

CFG = EndpointConfig(full_bytes=16 << 10, small_bytes=1 << 10)
LAYERS = (0, "v")
SLOTS = 8


class RaisingIndex:
    """An object whose ``__index__`` raises something other than TypeError."""

    def __index__(self) -> int:
        raise ValueError("not today")

    def __repr__(self) -> str:
        return "RaisingIndex()"


ODD = [RaisingIndex(), object(), np.int64(3), np.float32(1.5), np.array([1, 2]), np.array(3),
       torch.tensor([1, 2]), torch.tensor(1.5), torch.tensor(2), slice(1), Ellipsis, math.nan,
       math.inf, 10 ** 100, -(10 ** 100), "１２", "²", b"\x00", bytearray(b"k"), 1j, frozenset({1}),
       range(3), (x for x in [0]), {"k": 1}.keys()]

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                    st.binary(max_size=8), st.sampled_from(ODD))
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.tuples(inner, inner),
    st.dictionaries(st.one_of(st.integers(), st.text(max_size=3)), inner, max_size=2),
    st.frozensets(st.integers(), max_size=2)), max_leaves=6)
#: layers: junk, or a list mixing real, unknown and junk ids
layer_lists = st.one_of(junk, st.lists(st.one_of(st.sampled_from(LAYERS), junk), max_size=3))
#: slots: junk, or an int near the valid range
slots = st.one_of(junk, st.integers(-2, SLOTS + 2))
#: keys: junk, or a valid one
keys = st.one_of(junk, st.sampled_from([1, "k", b"k"]))

HYP = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _caches() -> dict[Any, torch.Tensor]:
    return {0: torch.zeros(SLOTS, 256), "v": torch.zeros(SLOTS, 16, dtype=torch.int8)}


@pytest.fixture(scope="module")
def opened() -> Iterator[tuple[BlockingPortal, Endpoint, Endpoint]]:
    """Two connected in-process endpoints, open for the whole module (the calls run in
    their event loop through a blocking portal)."""
    fabric = LocalFabric()
    a, b = Endpoint(0, _caches(), fabric.transport(), CFG), Endpoint(1, _caches(), fabric.transport(), CFG)
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(a), portal.wrap_async_context_manager(b):
            assert portal.call(a.connect, b.address) == 1
            yield portal, a, b


def _published(ep: Endpoint) -> dict[Any, dict[Any, int]]:
    return {layer: dict(keys) for layer, keys in ep._source.published.items()}


@HYP
@given(key=keys, slot=slots, layers=st.one_of(st.none(), layer_lists))
def test_publish_and_unpublish_raise_only_library_errors(opened, key, slot, layers):
    _, a, _ = opened
    before = _published(a)
    try:
        a.publish(key, slot, layers=layers)
    except XavierError as exc:
        assert isinstance(exc, InvalidRequestError), exc
        assert _published(a) == before                 # a refused publish publishes nothing
    try:
        a.unpublish(key, layers=layers)
    except XavierError as exc:
        assert isinstance(exc, InvalidRequestError), exc


@HYP
@given(address=st.one_of(junk, st.text(max_size=30), st.sampled_from(["local://1", "local://99"])),
       timeout=st.one_of(st.none(), junk, st.floats(min_value=0.01, max_value=5)))
def test_connect_raises_only_library_errors(opened, address, timeout):
    portal, a, _ = opened
    try:
        rank = portal.call(lambda: a.connect(address, timeout=timeout))
    except XavierError as exc:
        assert isinstance(exc, (HandshakeError, InvalidRequestError)), exc
    else:
        assert rank == 1 and address == "local://1"
    assert a.peers == (1,)                              # nothing else happened


@HYP
@given(peer=st.one_of(junk, st.integers(0, 5)))
def test_disconnect_raises_only_library_errors(opened, peer):
    portal, a, b = opened
    try:
        portal.call(a.disconnect, peer)
    except XavierError as exc:
        assert isinstance(exc, InvalidRequestError), exc
    if a.peers != (1,):                                 # a valid disconnect of rank 1: reconnect
        assert portal.call(a.connect, b.address) == 1


@pytest.mark.parametrize("layers", [5, "ab", b"ab", 1.5, None.__class__, torch.tensor(0), [[0]], [None]])
def test_publish_with_layers_that_are_not_a_list_of_ids_is_refused(layers):
    ep = Endpoint(0, _caches(), None, CFG)
    with pytest.raises(InvalidRequestError, match="layer"):
        ep.publish("k", 1, layers=layers)
    with pytest.raises(InvalidRequestError, match="layer"):
        ep.unpublish("k", layers=layers)
    assert _published(ep) == {0: {}, "v": {}}


@pytest.mark.parametrize("slot", [RaisingIndex(), "1", 1.0, None, [1]])
def test_publish_checks_the_slot_even_for_no_layers(slot):
    ep = Endpoint(0, _caches(), None, CFG)
    with pytest.raises(InvalidRequestError, match="slot"):
        ep.publish("k", slot, layers=[])


@pytest.mark.parametrize("key", [None, [1], {"a": 1}, 1.5, True])
def test_unpublish_of_a_malformed_key_is_refused(key):
    ep = Endpoint(0, _caches(), None, CFG)
    with pytest.raises(InvalidRequestError, match="block keys"):
        ep.unpublish(key)


# -- NIXL addresses (parsing needs no NIXL; a connect through a transport does) -----------

BAD_ADDRESSES = ["host:port:x", "[::1", "::1]:80", "a:99999", "a:0", "a:１２", "a:²", "a:+80", "a: 80",
                 "a:", ":80", "a", "[nothost]:80", "a b:80", "a\x00b:80", "a\nb:80", "x" * 300 + ":80",
                 "a..b:80", "1:2:3:80", "nixl://", "[]:80"]


@pytest.mark.parametrize("address", BAD_ADDRESSES)
def test_malformed_nixl_addresses_are_refused_before_dialling(address):
    with pytest.raises(HandshakeError) as info:
        parse_address(address)
    assert info.value.reason == "address" and "bad peer address" in str(info.value)


@pytest.mark.parametrize("address, want", [
    ("127.0.0.1:7000", ("127.0.0.1", 7000)), ("nixl://host-1.example:80", ("host-1.example", 80)),
    ("[::1]:7000", ("::1", 7000)), ("::1:7000", ("::1", 7000)), ("[fe80::1%eth0]:9", ("fe80::1%eth0", 9)),
    ("localhost:65535", ("localhost", 65535)),
])
def test_well_formed_nixl_addresses_parse(address, want):
    assert parse_address(address) == want


@settings(max_examples=2000, deadline=None)
@given(address=st.one_of(st.text(), st.from_regex(r"\A(nixl://)?\[?[ -~\u00b2\uff10-\uff19]{0,12}\]?:[0-9\uff11\u00b2+ -]{0,7}\Z")))
def test_parse_address_raises_only_handshake_errors(address):
    try:
        host, port = parse_address(address)
    except HandshakeError as exc:
        assert exc.reason == "address"
    else:
        assert isinstance(host, str) and host and type(port) is int and 0 < port < 65536


@pytest.fixture(scope="module")
def nixl_opened() -> Iterator[tuple[BlockingPortal, Endpoint]]:
    ep = Endpoint(0, _caches(), NixlTransport(), CFG)
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(ep):
            yield portal, ep


@requires_nixl
@pytest.mark.parametrize("address", [*BAD_ADDRESSES, None, 5, b"127.0.0.1:80", ["a:1"]])
def test_nixl_connect_refuses_malformed_addresses_with_a_library_error(nixl_opened, address):
    portal, ep = nixl_opened
    with pytest.raises(HandshakeError) as info:
        portal.call(lambda: ep.connect(address, timeout=5))
    assert "bad peer address" in str(info.value) or "must be a non-empty string" in str(info.value)
    assert ep.peers == ()
