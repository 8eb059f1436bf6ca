"""The vLLM connector's pure parts, without vLLM: settings, the directory, the scheduler's
planning, the step plan, the feed's updates, the KV layout, and the ``Announce`` message."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings, strategies as st

from xavier_async import InvalidRequestError, LayoutMismatchError
from xavier_async.protocol import Announce, ProtocolError, announce_wires, decode
from xavier_async.vllm import ConnectorSettings, Directory, Hit, StepPlan
from xavier_async.vllm.feed import apply, snapshot
from xavier_async.vllm.settings import HOST_DIRECT_WRITE_REGIONS
from xavier_async.vllm.kvlayout import endpoint_caches
from xavier_async.vllm.scheduler import SchedulerSide, block_key

BASE = {"rank": 0, "listen": "127.0.0.1:7311", "peers": ["127.0.0.1:7312"]}


# -- settings -----------------------------------------------------------------------------
def test_the_contract_keys_parse_with_defaults():
    s = ConnectorSettings.parse(BASE)
    assert (s.rank, s.listen, s.peers, s.load_mode, s.verify) == (
        0, "127.0.0.1:7311", ("127.0.0.1:7312",), "sync", False)
    assert s.listen_of(1) == "127.0.0.1:7312" and s.peers_of(2) == ("127.0.0.1:7314",)
    assert ConnectorSettings.parse({**BASE, "peers": []}).peers == ()
    # inside an engine the poller never spins past an empty poll (docs/benchmarks.md)
    assert (s.poll_hot_window, s.idle_poll) == (0.0, 0.0005)
    assert ConnectorSettings.parse({**BASE, "poll_hot_window": 0.002}).poll_hot_window == 0.002
    # the store's pages are touched at start: no publish pays first-touch faults
    assert s.prefault_snapshots is True
    assert ConnectorSettings.parse({**BASE, "prefault_snapshots": False}).prefault_snapshots is False
    # host caches serve from the store by direct writes of up to 64 regions (the gather is
    # the engine's CPU time); a GPU keeps the library's default; a value given is used
    assert s.direct_write_regions is None
    assert s.direct_write_regions_for("cpu") == HOST_DIRECT_WRITE_REGIONS == 64
    assert s.direct_write_regions_for("cuda") is None
    s0 = ConnectorSettings.parse({**BASE, "direct_write_regions": 0})
    assert s0.direct_write_regions_for("cpu") == s0.direct_write_regions_for("cuda") == 0


@pytest.mark.parametrize("extra,words", [
    (None, "kv_connector_extra_config"),
    ({"listen": "127.0.0.1:1"}, "'rank'"),
    ({"rank": 0}, "'listen'"),
    ({**BASE, "rank": -1}, "rank"),
    ({**BASE, "rank": True}, "rank"),
    ({**BASE, "listen": "nohost"}, "listen"),
    ({**BASE, "listen": "h:0"}, "listen"),
    ({**BASE, "listen": 7311}, "listen"),
    ({**BASE, "peers": "127.0.0.1:7312"}, "peers"),
    ({**BASE, "peers": ["127.0.0.1:7311"]}, "own"),
    ({**BASE, "peers": ["a:1", "a:1"]}, "twice"),
    ({**BASE, "load_mode": "eager"}, "load_mode"),
    ({**BASE, "verify": "yes"}, "verify"),
    ({**BASE, "secret": ""}, "secret"),
    ({**BASE, "snapshot_bytes": -1}, "snapshot_bytes"),
    ({**BASE, "load_timeout": 0}, "load_timeout"),
    ({**BASE, "connect_timeout": float("nan")}, "connect_timeout"),
    ({**BASE, "min_load_blocks": 0}, "min_load_blocks"),
    ({**BASE, "stats_file": 3}, "stats_file"),
    ({**BASE, "poll_hot_window": -1}, "poll_hot_window"),
    ({**BASE, "idle_poll": 0}, "idle_poll"),
    ({**BASE, "prefault_snapshots": 1}, "prefault_snapshots"),
    ({**BASE, "direct_write_regions": -1}, "direct_write_regions"),
    ({**BASE, "direct_write_regions": 2.5}, "direct_write_regions"),
    ({**BASE, "rnak": 1}, "unknown"),
])
def test_bad_settings_name_the_key(extra, words):
    with pytest.raises(InvalidRequestError, match=words):
        ConnectorSettings.parse(extra)


# -- the directory ------------------------------------------------------------------------
def test_longest_prefers_the_longest_run_of_one_peer():
    d = Directory()
    d.published(1, [10, 11])
    d.published(2, [10, 11, 12, 13])
    d.published(3, [11, 12, 13, 14])      # not from the start: no use
    keys = [10, 11, 12, 13, 14]
    hit = d.longest(keys, 0, 10)
    assert (hit.peer, hit.start, hit.blocks) == (2, 0, 4)
    assert d.longest(keys, 0, 2).blocks == 2 and d.longest(keys, 0, 2).peer == 1   # a tie: lowest rank
    assert d.longest(keys, 1, 10) == Hit(3, 1, 4)                 # from block 1, peer 3 holds more
    d.evicted(2, [12])
    assert (d.longest(keys, 0, 10).peer, d.longest(keys, 0, 10).blocks) == (1, 2)
    d.gone(1)
    assert d.longest(keys, 0, 10) == Hit(2, 0, 2)
    d.replace(2, [])
    assert d.longest(keys, 0, 10) is None and d.longest(keys, 1, 10).peer == 3
    assert d.longest(keys, 9, 1) is None and d.longest(keys, 0, 0) is None


ops = st.lists(st.tuples(st.sampled_from(["published", "evicted", "replace", "gone"]),
                         st.integers(0, 3), st.lists(st.integers(0, 7), max_size=6)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(st.integers(0, 7), min_size=1, max_size=8), st.integers(0, 7), st.integers(1, 9))
def test_the_directory_matches_a_naive_model(updates, keys, start, limit):
    d, model = Directory(), {p: set() for p in range(4)}
    for op, peer, ks in updates:
        apply(d, {"op": op, "peer": peer, "keys": ks})
        if op == "published":
            model[peer] |= set(ks)
        elif op == "evicted":
            model[peer] -= set(ks)
        elif op == "replace":
            model[peer] = set(ks)
        else:
            model[peer] = set()
    for p in range(4):
        assert d.keys_of(p) == model[p]
    # what a resync sends rebuilds the same directory
    again = Directory()
    for u in snapshot(d):
        apply(again, u)
    assert all(again.keys_of(p) == model[p] for p in range(4))
    best = 0
    for p in range(4):
        n = 0
        while start + n < len(keys) and n < limit and keys[start + n] in model[p]:
            n += 1
        best = max(best, n)
    hit = d.longest(keys, start, limit)
    assert (hit.blocks if hit else 0) == best
    if hit:
        assert all(k in model[hit.peer] for k in keys[start:start + hit.blocks])


# -- the scheduler's planning ----------------------------------------------------------------
@dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    block_hashes: list
    num_computed_tokens: int = 0


def hashes(n, salt=b""):
    return [bytes([i]) * 24 + salt + i.to_bytes(8, "big") for i in range(n)]


def test_block_keys_are_vllm_s_64_bit_form():
    h = bytes(range(32))
    assert block_key(h) == int.from_bytes(h, "big") & (2**64 - 1)
    assert block_key(2**70 + 5) == 5
    with pytest.raises(TypeError):
        block_key(1.5)


def test_a_hit_leaves_one_prompt_token_and_plans_the_load():
    d = Directory()
    hs = hashes(8)
    d.published(1, [block_key(h) for h in hs])
    slots = {"r": list(range(100, 109))}
    s = SchedulerSide(d, 128, sync=True, blocks_of=lambda rid: slots[rid])
    req = Req("r", 1024, hs)                      # 8 full blocks: 7 may load, one token is left
    assert s.matched_tokens(req, 0) == (7 * 128, False)
    assert s.matched_tokens(Req("q", 1025, hs), 0) == (8 * 128, False)
    s.after_alloc(req, slots["r"], 7 * 128)
    plan = s.build({})
    assert [(l.peer, l.keys, l.slots, l.sync) for l in plan.loads] == [
        (1, tuple(block_key(h) for h in hs[:7]), tuple(range(100, 107)), True)]
    assert s.build({}).loads == ()                # a plan is built once
    pickle.loads(pickle.dumps(plan))              # vLLM pickles it to the workers
    assert (s.lookups, s.hits, s.hit_blocks) == (2, 1, 7)


def test_local_prefix_hits_are_not_asked_for_again_and_short_hits_are_refused():
    d = Directory()
    hs = hashes(6)
    d.published(2, [block_key(h) for h in hs])
    s = SchedulerSide(d, 128, sync=False, min_load_blocks=3)
    assert s.matched_tokens(Req("r", 6 * 128 + 1, hs), 2 * 128) == (4 * 128, True)
    assert s.matched_tokens(Req("r", 6 * 128 + 1, hs), 4 * 128) == (0, False)   # 2 < 3 blocks
    assert s.matched_tokens(Req("r", 100, hs), 0) == (0, False)                 # no full block


def test_no_hit_when_nobody_holds_the_first_block():
    d = Directory()
    hs = hashes(4)
    d.published(1, [block_key(h) for h in hs[1:]])
    s = SchedulerSide(d, 128, sync=True)
    assert s.matched_tokens(Req("r", 4 * 128 + 1, hs), 0) == (0, False)
    s.after_alloc(Req("r", 513, hs), [1, 2, 3, 4], 0)
    assert s.build({}).empty


def test_completed_blocks_are_published_once_per_step():
    hs = hashes(4)
    slots = [7, 8, 9, 10]
    s = SchedulerSide(Directory(), 128, sync=True, blocks_of=lambda rid: slots)
    r = Req("r", 4 * 128, hs)
    s.on_new_request(r)
    r2 = Req("r2", 4 * 128, hs)                   # the same prefix in another request
    s.on_new_request(r2)
    plan = s.build({"r": 300, "r2": 300})         # blocks 0 and 1 are complete after this step
    assert plan.publish_keys == tuple(block_key(h) for h in hs[:2]) and plan.publish_slots == (7, 8)
    r.num_computed_tokens = 300
    plan = s.build({"r": 200})                    # block 2 completes, block 3 does not
    assert plan.publish_keys == (block_key(hs[2]),) and plan.publish_slots == (9,)
    assert s.build({"gone": 5}).empty


def test_an_async_load_of_a_finished_request_delays_its_free():
    d = Directory()
    hs = hashes(3)
    d.published(1, [block_key(h) for h in hs])
    s = SchedulerSide(d, 128, sync=False)
    r = Req("r", 3 * 128 + 1, hs)
    assert s.matched_tokens(r, 0) == (3 * 128, True)
    s.after_alloc(r, [4, 5, 6], 3 * 128)
    assert not s.build({}).loads[0].sync
    assert s.finished(r) is True                  # still loading: vLLM must wait for us
    assert s.build({}).delayed_frees == ("r",)
    r2 = Req("r2", 3 * 128 + 1, hs)
    s.matched_tokens(r2, 0)
    s.after_alloc(r2, [1, 2, 3], 3 * 128)
    s.loads_finished({"r2"})
    assert s.finished(r2) is False


def test_an_allocation_that_does_not_match_the_hit_is_an_error():
    d = Directory()
    hs = hashes(3)
    d.published(1, [block_key(h) for h in hs])
    s = SchedulerSide(d, 128, sync=True)
    r = Req("r", 3 * 128 + 1, hs)
    s.matched_tokens(r, 0)
    with pytest.raises(ValueError, match="do not match"):
        s.after_alloc(r, [1], 3 * 128)


# -- the KV layout -------------------------------------------------------------------------------
def test_the_cpu_layout_is_one_cache_per_layer_in_layer_order():
    buf = torch.zeros(3 * 16 * 2 * 4 * 8, dtype=torch.bfloat16)
    kv = {f"model.layers.{i}.self_attn.attn": buf[i * 1024:(i + 1) * 1024].view(16, 2, 4, 8)
          for i in (2, 0, 1)}
    caches, kind = endpoint_caches(kv, 16)
    assert kind == "blocks-first" and list(caches) == [0, 1, 2]
    assert caches[2].data_ptr() == kv["model.layers.2.self_attn.attn"].data_ptr()


def test_the_gpu_layout_splits_k_and_v():
    kv = {f"model.layers.{i}.attn": torch.zeros(2, 16, 4, 2, 8) for i in range(2)}
    caches, kind = endpoint_caches(kv, 16)
    assert kind == "kv-first" and sorted(caches) == [0, 1, 2, 3]
    assert caches[1].data_ptr() == kv["model.layers.0.attn"][1].data_ptr()


def test_an_unknown_layout_is_refused_by_name():
    with pytest.raises(LayoutMismatchError, match="model.layers.0"):
        endpoint_caches({"model.layers.0": torch.zeros(4, 16, 2)}, 16)
    with pytest.raises(LayoutMismatchError, match="no KV cache"):
        endpoint_caches({}, 16)


# -- the Announce message ---------------------------------------------------------------------
@given(st.lists(st.one_of(st.integers(0, 2**64 - 1), st.text(max_size=5), st.binary(max_size=5)),
                max_size=1200),
       st.lists(st.integers(0, 2**64 - 1), max_size=600), st.booleans())
@settings(max_examples=100, deadline=None)
def test_announcements_round_trip_in_pieces(published, evicted, replace):
    msgs = [decode(w) for w in announce_wires(published, evicted, replace)]
    assert all(isinstance(m, Announce) for m in msgs)
    assert [k for m in msgs for k in m.published] == published
    assert [k for m in msgs for k in m.evicted] == evicted
    assert [m.replace for m in msgs] == [replace] + [False] * (len(msgs) - 1)


@pytest.mark.parametrize("body", [b'[[1],[2]]', b'[[1],[2],2]', b'[[1.5],[],0]', b'[[-1],[],0]',
                                  b'[{"x":1},[],0]', b'[[1],[],true]', b'[' + b'[1],' * 0 + b'[' +
                                  b','.join([b'1'] * 513) + b'],[],0]'])
def test_malformed_announcements_are_protocol_errors(body):
    with pytest.raises(ProtocolError):
        decode(b"XAN" + body)


def test_the_step_plan_is_empty_by_default():
    assert StepPlan().empty and not StepPlan(publish_keys=(1,), publish_slots=(2,)).empty
