"""The connector's worker side: one :class:`~xavier_async.Endpoint` per worker process.

vLLM calls the worker's hooks on its main thread, with no event loop. The endpoint lives
on an event-loop thread of its own (an anyio blocking portal) in one task that owns it and
the connector's background tasks (dialling peers, announcing); each hook is one
``portal.call`` (a sync load, a publish) or ``portal.start_task_soon`` (an async load).

Publishing copies the step's completed blocks into the endpoint's snapshot store before
``wait_for_save`` returns, so vLLM may reuse their slots at once; the announcement to the
peers goes out after, off the step. Every peer's announcements update a mirror of the
directory here, relayed to the scheduler process by :mod:`~xavier_async.vllm.feed`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

import anyio
import anyio.abc
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from ..config import EndpointConfig
from ..endpoint import Endpoint
from ..errors import LayoutMismatchError, RemoteError, XavierError
from ..protocol import Announce
from .directory import Directory
from .feed import FeedClient, feed_name, snapshot
from .kvlayout import endpoint_caches
from .metadata import LoadSpec, StepPlan
from .settings import ConnectorSettings

log = logging.getLogger("xavier_async.vllm")


class WorkerSide:
    """The endpoint of TP worker ``tp_rank`` and what vLLM's worker hooks do with it."""

    def __init__(self, settings: ConnectorSettings, tp_rank: int = 0) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        self.listen = settings.listen_of(tp_rank)
        self.peer_addresses = settings.peers_of(tp_rank)
        self.stats_file = (settings.stats_file.replace("{tp}", str(tp_rank))
                           if settings.stats_file else None)
        self.mirror = Directory()
        self._mirror_lock = threading.Lock()
        self._lock = threading.Lock()   # what hooks and loop callbacks share below
        self._done_recv: set[str] = set()
        self._errors: dict[str, set[int]] = {}   # req id -> block ids that failed to load
        self._report_errors: set[int] = set()
        self._async: dict[str, Future[None]] = {}
        self._delayed: set[str] = set()
        self._published: set[int] = set()
        self.stats: dict[str, float] = dict.fromkeys((
            "loads", "load_failures", "blocks_loaded", "bytes_loaded", "publishes",
            "blocks_published", "blocks_evicted", "blocks_skipped", "publish_seconds",
            "load_seconds", "announces_received", "peers_joined", "peers_lost",
            # time.monotonic() (system-wide on Linux: comparable between replicas of one
            # host) of the last step end that published and of the last announcement
            # received (the bench's announcement latency)
            "last_publish_step_end", "last_announce_received",
            # seconds the steps waited for their sync loads (before the forward)
            "sync_load_seconds"), 0)
        self.stats["rank"] = settings.rank
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._serving: Future[Any] | None = None
        self._stop: anyio.Event | None = None
        self._ep: Endpoint | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._feed: FeedClient | None = None
        self._closed = False
        self._stats_dirty = True
        self._direct_written = 0

    # -- start and stop -----------------------------------------------------------------
    def start(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """``register_kv_caches``: open the endpoint over vLLM's tensors and start
        dialling the peers (they may come up later, in any order)."""
        caches, kind = endpoint_caches(kv_caches, num_blocks)
        self.stats["layout_" + kind.replace("-", "_")] = 1
        self.stats["cache_tensors"] = len(caches)
        self.stats["block_bytes"] = sum(t[0].numel() * t.element_size() for t in caches.values())
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._serving, _ = self._portal.start_task(self._serve, caches)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal = self._portal_cm = None
            raise
        if self.tp_rank == 0:
            self._feed = FeedClient(feed_name(self.settings.listen), self._full_mirror)
        self.write_stats()

    def _config(self, device_type: str) -> EndpointConfig:
        s = self.settings
        kw: dict[str, Any] = dict(snapshot_gpu_bytes=s.snapshot_bytes, verify=s.verify,
                                  request_timeout=s.load_timeout,
                                  snapshot_prefault=s.prefault_snapshots,
                                  direct_write_regions=s.direct_write_regions_for(device_type))
        if s.host_snapshot_bytes is not None:
            kw["snapshot_cpu_bytes"] = s.host_snapshot_bytes
        return EndpointConfig(**kw)

    async def _serve(self, caches: dict[int, torch.Tensor], *,
                     task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        from ..transports.nixl import NixlTransport
        s = self.settings
        host, port = self.listen.rsplit(":", 1)
        transport = NixlTransport(host=host.strip("[]"), port=int(port), secret=s.secret,
                                  hot_window=s.poll_hot_window, idle_poll=s.idle_poll)
        self._stop = anyio.Event()
        device = next(iter(caches.values())).device.type
        async with Endpoint(s.rank, caches, transport, self._config(device)) as ep:
            ep.watch(self)
            async with anyio.create_task_group() as tg:
                self._ep, self._tg = ep, tg
                for address in self.peer_addresses:
                    tg.start_soon(self._dial, address)
                task_status.started()
                await self._stop.wait()
                tg.cancel_scope.cancel()
            self._ep = None

    async def _dial(self, address: str) -> None:
        """Keep a connection to the peer at ``address`` (retrying while it is not up)."""
        assert self._ep is not None
        ep, rank, warned = self._ep, None, False
        while True:
            if rank is None or rank not in ep.peers:
                try:
                    rank = await ep.connect(address, timeout=self.settings.connect_timeout)
                except LayoutMismatchError as exc:
                    if not warned:
                        log.error("xavier connector: the replica at %s has another KV layout (a "
                                  "different model, block size or tensor-parallel size); it is "
                                  "not used: %s", address, exc)
                        warned = True
                    await anyio.sleep(5.0)
                    continue
                except XavierError as exc:
                    log.debug("xavier connector: %s not reachable yet: %s", address, exc)
            await anyio.sleep(0.25)

    def shutdown(self) -> None:
        """Drain the loads in flight and close the endpoint (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._feed is not None:
            self._feed.close()
        portal = self._portal
        if portal is not None:
            for fut in list(self._async.values()):
                try:
                    fut.result(timeout=self.settings.load_timeout + 1)
                except BaseException:
                    pass
            try:
                if self._stop is not None:
                    portal.call(self._stop.set)
                if self._serving is not None:
                    self._serving.result(timeout=30)
            except BaseException:
                log.debug("xavier connector: closing the endpoint failed", exc_info=True)
            finally:
                assert self._portal_cm is not None
                self._portal_cm.__exit__(None, None, None)
                self._portal = self._portal_cm = None
        self.write_stats()

    # -- the directory's mirror (called on the loop thread) ------------------------------
    def joined(self, peer: int) -> None:
        self.stats["peers_joined"] += 1
        self._update({"op": "gone", "peer": peer})
        if self._tg is not None and self._ep is not None:
            self._tg.start_soon(self._greet, peer)

    async def _greet(self, peer: int) -> None:
        if self._ep is not None and not self._ep.closed:
            await self._ep.announce(sorted(self._published), replace=True, peers=[peer])

    def lost(self, peer: int) -> None:
        self.stats["peers_lost"] += 1
        self._update({"op": "gone", "peer": peer})

    def announced(self, peer: int, message: Announce) -> None:
        self.stats["announces_received"] += 1
        self.stats["last_announce_received"] = time.monotonic()
        if message.replace:
            self._update({"op": "replace", "peer": peer, "keys": list(message.published)})
        if message.evicted:
            self._update({"op": "evicted", "peer": peer, "keys": list(message.evicted)})
        if message.published and not message.replace:
            self._update({"op": "published", "peer": peer, "keys": list(message.published)})
        self._stats_dirty = True
        if self.stats_file:   # tests and the bench read it while this replica is idle
            self.write_stats()

    def _update(self, update: dict[str, Any]) -> None:
        from .feed import apply
        with self._mirror_lock:
            apply(self.mirror, update)
        if self._feed is not None:
            self._feed.send(update)

    def _full_mirror(self) -> list[dict[str, Any]]:
        with self._mirror_lock:
            return snapshot(self.mirror)

    # -- each step -----------------------------------------------------------------------
    def start_load_kv(self, plan: StepPlan) -> None:
        """Run the plan's sync loads now (before the forward); start its async ones."""
        portal = self._portal
        if portal is None:
            return
        sync = [spec for spec in plan.loads if spec.sync]
        for spec in plan.loads:
            if not spec.sync:
                self._async[spec.req_id] = portal.start_task_soon(self._load_async, spec)
        if sync:
            t0 = time.perf_counter()
            portal.call(self._load_all, sync)
            self.stats["sync_load_seconds"] += time.perf_counter() - t0
        with self._lock:
            self._delayed.update(plan.delayed_frees)

    async def _load_all(self, specs: Sequence[LoadSpec]) -> None:
        async with anyio.create_task_group() as tg:
            for spec in specs:
                tg.start_soon(self._load_one, spec)

    async def _load_async(self, spec: LoadSpec) -> None:
        try:
            await self._load_one(spec)
        finally:
            with self._lock:
                self._done_recv.add(spec.req_id)

    async def _load_one(self, spec: LoadSpec) -> None:
        ep = self._ep
        t0 = time.perf_counter()
        try:
            if ep is None:
                raise XavierError("the endpoint is closed")
            result = await ep.load_blocks(spec.peer, spec.keys, spec.slots)
        except XavierError as exc:
            log.info("xavier connector: loading %d blocks of %s from rank %d failed (vLLM "
                     "recomputes them): %s", len(spec.keys), spec.req_id, spec.peer, exc)
            self.stats["load_failures"] += 1
            if isinstance(exc, RemoteError):  # the peer no longer holds (some of) them
                self._update({"op": "evicted", "peer": spec.peer, "keys": list(spec.keys)})
            with self._lock:
                self._errors.setdefault(spec.req_id, set()).update(spec.slots)
                if spec.sync:
                    self._report_errors.update(spec.slots)
        else:
            self.stats["loads"] += 1
            self.stats["blocks_loaded"] += len(spec.keys)
            self.stats["bytes_loaded"] += result.useful_bytes
        finally:
            self.stats["load_seconds"] += time.perf_counter() - t0
            self._stats_dirty = True

    def wait_for_save(self, plan: StepPlan) -> None:
        """Publish the blocks this step completed (copied into the store on return)."""
        portal = self._portal
        if portal is None or not plan.publish_keys:
            return
        keys, slots = [], []
        for key, slot in zip(plan.publish_keys, plan.publish_slots):
            if key not in self._published:
                keys.append(key)
                slots.append(slot)
        if keys:
            self.stats["last_publish_step_end"] = time.monotonic()
            t0 = time.perf_counter()
            portal.call(self._publish, keys, slots)
            self.stats["publish_seconds"] += time.perf_counter() - t0
            self._stats_dirty = True

    async def _publish(self, keys: list[int], slots: list[int]) -> None:
        ep = self._ep
        if ep is None or ep.closed:
            return
        try:
            res = await ep.publish_blocks(keys, slots)
        except XavierError as exc:
            log.warning("xavier connector: publishing %d blocks failed: %s", len(keys), exc)
            return
        self._published.update(k for k in res.available if isinstance(k, int))
        self._published.difference_update(k for k in res.evicted if isinstance(k, int))
        self.stats["publishes"] += 1
        self.stats["blocks_published"] += len(res.available)
        self.stats["blocks_evicted"] += len(res.evicted)
        self.stats["blocks_skipped"] += len(res.skipped) + len(res.failed)
        if self._tg is not None and (res.available or res.evicted):
            self._tg.start_soon(self._announce, list(res.available), list(res.evicted))

    async def _announce(self, published: list[Any], evicted: list[Any]) -> None:
        if self._ep is not None and not self._ep.closed:
            await self._ep.announce(published, evicted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads that ended since the last step (with their errors queued for
        :meth:`load_errors`), and finished requests whose delayed free may now go."""
        with self._lock:
            recv, self._done_recv = self._done_recv, set()
            for rid in recv:
                self._async.pop(rid, None)
                self._report_errors.update(self._errors.pop(rid, ()))
            for rid in [r for r in self._errors if r not in self._async]:  # sync ones
                self._errors.pop(rid)
            sending = {rid for rid in self._delayed if rid not in self._async}
            self._delayed -= sending
            recv -= sending
        if self._stats_dirty or (self.stats_file and self._direct_writes() != self._direct_written):
            self.write_stats()
        return (sending or None), (recv or None)

    def load_errors(self) -> set[int]:
        with self._lock:
            out, self._report_errors = self._report_errors, set()
        return out

    def _direct_writes(self) -> int:
        """Serves this replica wrote straight from its snapshot store (a count the loop
        thread bumps; read from the engine's thread)."""
        return self._ep.direct_writes if self._ep is not None else 0

    def write_stats(self) -> None:
        """Write the stats as JSON to ``stats_file`` (when one is configured)."""
        self._stats_dirty = False
        if not self.stats_file:
            return
        self._direct_written = direct = self._direct_writes()
        tmp = f"{self.stats_file}.{os.getpid()}.{threading.get_ident()}.tmp"
        with self._mirror_lock:
            held = {str(p): _digest(self.mirror.keys_of(p)) for p in self.mirror.peers}
            keys = len(self.mirror)
        ep = self._ep
        stages = _stage_summary(ep.metrics.stages.as_dict()) if ep is not None else {}
        with open(tmp, "w") as f:
            json.dump(dict(self.stats, peers=list(ep.peers) if ep else [],
                           directory_keys=keys, directory_digests=held,
                           published_digest=_digest(self._published), stages=stages,
                           direct_writes=direct), f)
        os.replace(tmp, self.stats_file)


def _stage_summary(stages: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The endpoint's per-stage histograms as ``n``, ``p50_us`` and ``p99_us`` of each
    stage that ran (``stages.LoadStages``: receiver and source sides)."""
    return {side: {name: {"n": h["n"], "p50_us": h["p50_us"], "p99_us": h["p99_us"]}
                   for name, h in hists.items() if h["n"]}
            for side, hists in stages.items()}


def _digest(keys: Any) -> str:
    """A short digest of a set of block keys (for comparing two replicas' views)."""
    return hashlib.sha256(",".join(map(str, sorted(keys))).encode()).hexdigest()[:16]


__all__ = ["WorkerSide"]
