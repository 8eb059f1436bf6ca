"""The wire protocol and the serve decision, hammered without an event loop (pure core).

Arbitrary and hostile bytes go into :func:`decode`; arbitrary request bodies go into
:func:`parse_load` and :func:`decide`. Nothing may escape but :class:`ProtocolError` (from
decoding) or a :class:`Refuse` (from deciding), and well-formed messages round-trip.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xavier_async import ChannelPolicy, HandshakeError, LayoutMismatchError, RemoteError
from xavier_async.errors import PeerLostError, RegistrationError, TransferError, XavierError
from xavier_async.layout import CacheLayout
from xavier_async.planning import normalize, plan_batches
from xavier_async.decision import NeedsMapping, ParsedLoad, Ready, Refuse, decide, parse_load
from xavier_async.protocol import (ERROR_KINDS, PROTOCOL_VERSION, BlockLoad, Error, Hello, Landed, Load, Probe,
                                   ProtocolError, RequestTable, check_hello, decode)
from xavier_async.sizes import SlabSizes

LAYOUT = CacheLayout.of({0: torch.zeros(8, 4, dtype=torch.float32),      # 16 B blocks
                         "v": torch.zeros(8, 2, 8, dtype=torch.bfloat16)})  # 32 B blocks
FULL, SMALL = 4096, 256

keys = st.one_of(st.integers(-2**70, 2**70), st.text(max_size=8), st.binary(max_size=8))
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                         st.text(max_size=6))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=12)


# -- decoding ------------------------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_decode_turns_any_bytes_into_a_message_or_a_protocol_error(data):
    for msg in (data, b"XA" + data, b"XAL" + data, b"XAD" + data, b"XAE" + data, b"XAP" + data,
                b"XAB" + data):
        try:
            out = decode(msg)
        except ProtocolError:
            continue
        assert isinstance(out, (Load, BlockLoad, Landed, Error, Probe))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([b"L", b"D", b"E", b"P"]), json_values)
def test_decode_of_any_json_body_is_a_message_or_a_protocol_error(tag, body):
    try:
        out = decode(b"XA" + tag + json.dumps(body).encode())
    except ProtocolError:
        return
    assert type(out.req_id) is int
    if isinstance(out, Landed):
        assert type(out.wire_bytes) is int and out.wire_bytes >= 0
    if isinstance(out, Error):
        assert isinstance(out.kind, str) and isinstance(out.text, str)


@given(st.integers(0, 2**62), st.lists(st.tuples(st.sampled_from([0, "v"]),
                                                 st.lists(keys, min_size=1, max_size=4)), max_size=4))
def test_load_round_trips(req_id, items):
    batch = [[layer, ks] for layer, ks in items]
    assert decode(Load(req_id, batch).to_wire()) == Load(req_id, batch)


@given(st.integers(0, 2**62), st.integers(0, 2**40))
def test_landed_round_trips(req_id, n):
    assert decode(Landed(req_id, n).to_wire()) == Landed(req_id, n)


@pytest.mark.parametrize("exc", [PeerLostError("gone"), TransferError("x"), RegistrationError("r"),
                                 RemoteError("no"), HandshakeError("other kinds are refusals")])
def test_error_kinds_map_both_ways(exc):
    msg = decode(Error.of(9, exc).to_wire())
    assert isinstance(msg, Error) and msg.req_id == 9
    raised = msg.exception(peer=3)
    want = type(exc) if type(exc) in ERROR_KINDS.values() else RemoteError
    assert type(raised) is want and "rank 3" in str(raised)


def test_unknown_error_kind_is_a_remote_error():
    assert type(Error(1, "martian", "?").exception(0)) is RemoteError


# -- the serve decision ----------------------------------------------------------------------

def _published(n=8):
    return {0: {f"k{i}": i for i in range(n)}, "v": {f"k{i}": n - 1 - i for i in range(n)}}


def _load_of(request):
    plan = normalize({1: request}, LAYOUT)[1]
    (batch,) = plan_batches(plan, LAYOUT, FULL)
    return Load.of(5, batch), batch


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_parse_and_decide_refuse_anything_malformed(batch):
    parsed = parse_load(Load(11, batch), LAYOUT, FULL)
    if isinstance(parsed, Refuse):
        assert parsed.req_id == 11 and isinstance(parsed.error, XavierError)
        return
    assert isinstance(parsed, ParsedLoad) and 0 < parsed.payload <= FULL
    policy = ChannelPolicy(FULL, SMALL)
    d = decide(parsed, _published(), policy, {("full", 0), ("small", 0)})
    assert isinstance(d, (Refuse, Ready))
    assert policy.state == "full"          # deciding never advances the machine


def test_decide_follows_the_machine_and_the_mappings():
    load, batch = _load_of({0: {"k1": 0, "k2": 1}, "v": {"k1": 0, "k2": 1}})
    parsed = parse_load(load, LAYOUT, FULL)
    assert isinstance(parsed, ParsedLoad) and parsed.payload == batch.nbytes <= SMALL
    policy = ChannelPolicy(FULL, SMALL)
    assert decide(parsed, _published(), policy, set()) == NeedsMapping("full")
    ready = decide(parsed, _published(), policy, {("full", 0)})
    assert isinstance(ready, Ready) and ready.view == "full"
    assert [list(s) for s in ready.slot_lists] == [[1, 2], [6, 5]]
    policy.commit(parsed.payload)          # first small batch: streak_1, full view
    assert decide(parsed, _published(), policy, {("full", 0)}) == NeedsMapping("small")
    assert decide(parsed, _published(), policy, {("full", 0), ("small", 0)}).view == "small"


def test_decide_refuses_unpublished_and_oversized():
    load, _ = _load_of({0: {"k1": 0, "nope": 1}})
    parsed = parse_load(load, LAYOUT, FULL)
    d = decide(parsed, _published(), ChannelPolicy(FULL, SMALL), {("full", 0), ("small", 0)})
    assert isinstance(d, Refuse) and "nope" in str(d.error)
    assert isinstance(parse_load(load, LAYOUT, 8), Refuse)        # larger than this source's slab
    assert isinstance(parse_load(Load(1, [["w", [1]]]), LAYOUT, FULL), Refuse)   # unknown layer
    assert isinstance(parse_load(Load(1, []), LAYOUT, FULL), Refuse)             # empty


# -- requests and hellos -----------------------------------------------------------------------

def test_request_table_matches_replies_to_their_peer_only():
    done = []
    table = RequestTable()
    a = table.open(1, lambda: done.append("a"))
    b = table.open(2, lambda: done.append("b"))
    assert a.req_id != b.req_id
    assert table.reply(2, Landed(a.req_id, 10)) is None          # a reply from the wrong peer
    assert table.reply(1, Landed(999, 10)) is None               # a stray
    assert table.reply(1, Landed(a.req_id, 10)) is a and a.wire_bytes == 10 and done == ["a"]
    table.reply(1, Landed(a.req_id, 99))                         # resolves once
    assert a.wire_bytes == 10 and done == ["a"]
    table.fail(PeerLostError("x"), peer=2)
    assert isinstance(b.error, PeerLostError) and done == ["a", "b"]
    table.close(a)
    table.close(b)
    assert len(table) == 0


def _hello(rank=1, **over):
    h = Hello(rank, LAYOUT.wire(), SlabSizes(FULL, SMALL), "cpu").to_wire()
    h.update(over)
    return h


def test_check_hello_names_each_problem():
    local = Hello(0, LAYOUT.wire(), SlabSizes(FULL, SMALL), "cpu")
    assert check_hello(local, _hello(), LAYOUT) == 1
    cases = [(_hello(version=PROTOCOL_VERSION + 1), HandshakeError, "version"),
             (_hello(rank=0), HandshakeError, "same rank"),
             (_hello(rank=True), HandshakeError, "rank"),
             (_hello(full_bytes=FULL * 2), HandshakeError, "slab size"),
             (_hello(layout=[[0, [[5], "float32"]]]), LayoutMismatchError, "layout"),
             ("not a dict", HandshakeError, "malformed"),
             (_hello(layout=5), HandshakeError, "malformed")]
    for hello, exc, match in cases:
        with pytest.raises(exc, match=match):
            check_hello(local, hello, LAYOUT)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["version", "rank", "layout", "full_bytes", "small_bytes",
                                        "device", "x"]), json_values, max_size=7))
def test_check_hello_survives_hostile_hellos(fields):
    local = Hello(0, LAYOUT.wire(), SlabSizes(FULL, SMALL), "cpu")
    try:
        check_hello(local, {**_hello(), **fields}, LAYOUT)
    except (HandshakeError, LayoutMismatchError):  # the two documented refusals
        pass


# -- fencing fields (issue 9) ------------------------------------------------------------------

@given(st.integers(0, 2**62), st.integers(0, 2**31), st.integers(0, 64), st.booleans())
def test_load_with_epoch_slab_and_verify_round_trips(req_id, epoch, slab, verify):
    msg = Load(req_id, [[0, [1, "a"]]], epoch, slab, verify)
    assert decode(msg.to_wire()) == msg


@given(st.integers(0, 2**62), st.integers(0, 2**40), st.one_of(st.none(), st.text(max_size=40)))
def test_landed_with_a_digest_round_trips(req_id, n, digest):
    assert decode(Landed(req_id, n, digest).to_wire()) == Landed(req_id, n, digest)


@given(st.integers(0, 2**62), st.booleans())
def test_probe_and_settled_error_round_trip(req_id, settled):
    from xavier_async.protocol import Probe
    assert decode(Probe(req_id, [[0, [1]]], 3).to_wire()) == Probe(req_id, [[0, [1]]], 3)
    err = Error.of(req_id, TransferError("x"), settled)
    assert decode(err.to_wire()) == err and err.settled is settled


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_probe_check_and_peer_facts_never_raise(body):
    from xavier_async.decision import check_probe
    from xavier_async.protocol import Probe, peer_facts
    out = check_probe(Probe(1, body), LAYOUT, _published())
    assert out is None or isinstance(out, XavierError)
    hello = body if isinstance(body, dict) else {"rank": 1, "epochs": body, "unsettled": body}
    facts = peer_facts(0, hello, {1: 4})
    assert facts.min_epoch >= 1 and isinstance(facts.writes_unsettled, bool)


def test_peer_facts_and_stale_epochs():
    from xavier_async import StaleRequestError
    from xavier_async.decision import check_epoch
    from xavier_async.protocol import peer_facts
    facts = peer_facts(0, {"rank": 1, "incarnation": "x", "epochs": [[0, 6], [2, 9]],
                           "unsettled": [2]}, {1: 4})
    assert facts.epoch_as_receiver == 5 and facts.min_epoch == 7 and not facts.writes_unsettled
    assert peer_facts(0, {"rank": 1, "unsettled": [0]}, {}).writes_unsettled
    assert peer_facts(0, {"rank": 1}, {}).writes_unsettled          # unknown: unsafe answer
    refused = check_epoch(3, 6, 7)
    assert refused is not None and isinstance(refused.error, StaleRequestError)
    assert check_epoch(3, 7, 7) is None
    assert decode(Error.of(3, refused.error).to_wire()).exception(1).__class__ is StaleRequestError


def test_hellos_without_a_common_layer_are_refused():
    local = Hello(0, LAYOUT.wire(), SlabSizes(FULL, SMALL), "cpu")
    other = CacheLayout.of({"w": torch.zeros(8, 4, dtype=torch.float32)})
    peer = Hello(1, other.wire(), SlabSizes(FULL, SMALL), "cpu").to_wire()
    with pytest.raises(LayoutMismatchError, match="no layer id in common"):
        check_hello(local, peer, LAYOUT)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.lists(st.integers(0, 9), max_size=6),
                          st.booleans()), min_size=1, max_size=6),
       st.dictionaries(st.sampled_from([0, 1, 2]),
                       st.dictionaries(st.integers(0, 9), st.integers(0, 99), max_size=10)))
def test_slots_of_matches_one_lookup_per_key(segments, published):
    """``slots_of`` (one C call per segment, segments repeating the previous keys share
    them) gives exactly the per-key lookup, or refuses naming a key that is missing."""
    from xavier_async.planning import Segment
    from xavier_async.decision import slots_of
    segs, prev = [], ()
    for layer, keys, repeat in segments:
        keys = prev if repeat and segs else tuple(keys)  # the same tuple object, as from the wire
        segs.append(Segment(layer, keys, 0, 8))
        prev = keys
    got = slots_of(ParsedLoad(7, segs, 8, 8), published)
    try:
        want = [[published.get(s.layer, {})[k] for k in s.keys] for s in segs]
    except KeyError:
        assert isinstance(got, Refuse) and got.req_id == 7
        assert "not published" in str(got.error)
        return
    assert not isinstance(got, Refuse)
    assert [list(s) for s in got] == want
