"""The pure parse of a NIXL peer's handshake frame (no agent, no event loop)."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xavier_async.errors import HandshakeError
from xavier_async.transports.nixl_peer import _Peer, parse_peer_frame


def frame(**over: object) -> dict[str, object]:
    f: dict[str, object] = {"hello": {"rank": 3}, "meta": base64.b64encode(b"md").decode(),
                            "recv_ptr": 4096, "recv_dev": 0, "recv_slabs": {"1": 8192},
                            "mem": "DRAM", "bulk_agent": "a-bulk"}
    f.update(over)
    return f


def test_a_good_frame_parses_whole() -> None:
    hello, rank, meta, ptrs, dev, mem, bulk = parse_peer_frame(frame())
    assert (hello, rank, meta, ptrs, dev, mem, bulk) == (
        {"rank": 3}, 3, b"md", {0: 4096, 1: 8192}, 0, "DRAM", "a-bulk")
    f = frame()
    del f["recv_slabs"], f["bulk_agent"], f["mem"]
    assert parse_peer_frame(f)[3:] == ({0: 4096}, 0, "DRAM", None)


@pytest.mark.parametrize("over", [
    {"hello": {"rank": -1}}, {"hello": {"rank": True}}, {"hello": {}}, {"hello": 5},
    {"meta": "not base64!"}, {"recv_ptr": "x"}, {"recv_slabs": {"a": 1}}, {"mem": "HBM"},
    {"bulk_agent": ""}, {"bulk_agent": 7}])
def test_a_malformed_frame_is_a_handshake_error(over: dict[str, object]) -> None:
    with pytest.raises(HandshakeError, match="malformed handshake"):
        parse_peer_frame(frame(**over))


@given(st.dictionaries(st.sampled_from(["hello", "meta", "recv_ptr", "recv_dev", "recv_slabs",
                                        "mem", "bulk_agent"]),
                       st.one_of(st.none(), st.integers(), st.text(max_size=8),
                                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))))
def test_any_frame_parses_or_is_a_handshake_error(f: dict[str, object]) -> None:
    try:
        parse_peer_frame(f)
    except HandshakeError:
        pass


def test_the_peer_names_its_agents() -> None:
    p = _Peer(1, "a", {0: 1}, 0, "DRAM", None, {}, {0})  # type: ignore[arg-type]
    assert p.agents() == ("a",) and p.recv_ptr == 1
    p.bulk_agent = "a-bulk"
    assert p.agents() == ("a", "a-bulk")
