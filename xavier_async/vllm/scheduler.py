"""The connector's scheduler side: which prefix blocks to load, which to publish (pure).

It runs on vLLM's scheduler loop (the EngineCore process), synchronously: every answer
comes from the local :class:`~xavier_async.vllm.directory.Directory`, never from the
network. It reads vLLM's request and scheduler-output objects only through the few
fields named here, so tests can feed it plain objects (hypothesis does)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .directory import Directory, Hit
from .metadata import LoadSpec, StepPlan

MASK64 = (1 << 64) - 1


def block_key(block_hash: Any) -> int:
    """vLLM's block hash (chained sha256 ``bytes``) -> the 64-bit key it travels under:
    ``int.from_bytes(h, "big") & (2**64 - 1)``, vLLM's own 64-bit form."""
    if isinstance(block_hash, (bytes, bytearray)):
        return int.from_bytes(block_hash[-8:], "big")
    if isinstance(block_hash, int):
        return block_hash & MASK64
    inner = getattr(block_hash, "block_hash", None)  # (hash, group id) forms
    if inner is not None:
        return block_key(inner)
    raise TypeError(f"not a vLLM block hash: {type(block_hash).__name__}")


class SchedulerSide:
    """Answers ``get_num_new_matched_tokens`` and builds each step's :class:`StepPlan`.

    ``blocks_of(req_id)`` returns the request's block ids (vLLM's KV cache manager);
    ``lock`` guards the directory against the thread that feeds it."""

    def __init__(self, directory: Directory, block_size: int, *, sync: bool,
                 min_load_blocks: int = 1, lock: AbstractContextManager[Any] | None = None,
                 blocks_of: Callable[[str], Sequence[int]] | None = None) -> None:
        self.directory = directory
        self.block_size = block_size
        self.sync = sync
        self.min_load_blocks = min_load_blocks
        self._lock = lock if lock is not None else nullcontext()
        self.blocks_of = blocks_of
        self._requests: dict[str, Any] = {}
        self._hits: dict[str, Hit] = {}
        self._loads: list[LoadSpec] = []
        self._async_in_flight: set[str] = set()
        self._delayed: list[str] = []
        #: counters for stats: lookups, hits (requests), blocks asked for
        self.lookups = 0
        self.hits = 0
        self.hit_blocks = 0

    # -- requests ----------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def keys_of(self, request: Any, upto: int) -> list[int]:
        return [block_key(h) for h in request.block_hashes[:upto]]

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: the longest prefix one peer holds beyond the
        ``num_computed`` tokens vLLM has, leaving at least one prompt token to compute."""
        self.lookups += 1
        self._requests.setdefault(request.request_id, request)
        self._hits.pop(request.request_id, None)
        bs = self.block_size
        prompt = request.num_prompt_tokens
        most = min((prompt - 1) // bs, len(request.block_hashes))
        start = num_computed // bs
        if most <= start:
            return 0, False
        keys = self.keys_of(request, most)
        with self._lock:
            hit = self.directory.longest(keys, start, most - start)
        if hit is None or hit.blocks < self.min_load_blocks:
            return 0, False
        self._hits[request.request_id] = hit
        return (start + hit.blocks) * bs - num_computed, not self.sync

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external: int) -> None:
        """``update_state_after_alloc``: plan the load into the blocks vLLM gave."""
        hit = self._hits.pop(request.request_id, None)
        if num_external <= 0 or hit is None:
            return
        n = -(-num_external // self.block_size)
        first = hit.start
        if n > hit.blocks or first + n > len(block_ids):
            raise ValueError(f"request {request.request_id}: {num_external} external tokens do not "
                             f"match the {hit.blocks} blocks found")
        keys = tuple(self.keys_of(request, first + n)[first:])
        spec = LoadSpec(request.request_id, hit.peer, keys, tuple(block_ids[first:first + n]),
                        self.sync)
        self._loads.append(spec)
        self.hits += 1
        self.hit_blocks += n
        if not self.sync:
            self._async_in_flight.add(request.request_id)

    def loads_finished(self, req_ids: Any) -> None:
        """``update_connector_output``: these async loads have ended."""
        for rid in req_ids or ():
            self._async_in_flight.discard(rid)

    def finished(self, request: Any) -> bool:
        """``request_finished``: whether vLLM must wait for us before freeing its blocks
        (an async load still writing into them)."""
        rid = request.request_id
        self._requests.pop(rid, None)
        self._hits.pop(rid, None)
        if rid in self._async_in_flight:
            self._async_in_flight.discard(rid)
            self._delayed.append(rid)
            return True
        return False

    # -- each step ---------------------------------------------------------------------
    def build(self, scheduled: dict[str, int]) -> StepPlan:
        """``build_connector_meta``: ``scheduled`` is ``num_scheduled_tokens`` (request id
        -> tokens this step). Every block the step completes is published."""
        bs = self.block_size
        pkeys: list[int] = []
        pslots: list[int] = []
        seen: set[int] = set()
        for rid, n in scheduled.items():
            request = self._requests.get(rid)
            if request is None or n <= 0 or self.blocks_of is None:
                continue
            before = request.num_computed_tokens
            first, end = before // bs, min((before + n) // bs, len(request.block_hashes))
            if end <= first:
                continue
            slots = self.blocks_of(rid)
            for i, h in enumerate(request.block_hashes[first:end], first):
                key = block_key(h)
                if key not in seen and i < len(slots):
                    seen.add(key)
                    pkeys.append(key)
                    pslots.append(slots[i])
        plan = StepPlan(tuple(self._loads), tuple(pkeys), tuple(pslots), tuple(self._delayed))
        self._loads.clear()
        self._delayed.clear()
        return plan


__all__ = ["SchedulerSide", "block_key", "MASK64"]
