"""Run an endpoint in a child process, driven over a pipe (tests, benchmark, demos).

The child's caches are filled from a seed, so the parent can compute what every block
must contain (:func:`pattern_caches`) and check the bytes it loaded, and the child can
check what it loaded from the parent the same way. With ``PeerSpec.published`` only the
low slots hold the pattern (and are published); the slots above are the destination of
the child's own loads, e.g. a whole trace run by the ``replay`` command with many loads
in flight while the child serves (the serving bench's duplex topology).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .._checks import env_flag
from .child import ChildProcess, send_error, serve_commands
from .hostprof import ENV as HOST_PROFILE_ENV
from .hostprof import HostProfile
from .timeline import ENV as TIMELINE_ENV
from .timeline import Timeline

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "int8": torch.int8, "uint8": torch.uint8}


@dataclass(frozen=True)
class LayoutSpec:
    """A uniform test layout: ``layers`` caches of ``[num_slots, *block_shape]``."""

    layers: int = 4
    num_slots: int = 64
    block_shape: tuple[int, ...] = (2, 16, 8, 64)
    dtype: str = "bfloat16"
    #: layer 0 starts with all 65,536 BF16 bit patterns (needs dtype bfloat16)
    all_bf16_patterns: bool = False

    @property
    def block_nbytes(self) -> int:
        n = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        for d in self.block_shape:
            n *= d
        return n


def pattern_caches(spec: LayoutSpec, rank: int, seed: int, device: str | torch.device = "cpu",
                   ) -> dict[int, torch.Tensor]:
    """Deterministic caches: random bytes from ``(seed, rank, layer)``."""
    out = {}
    for layer in range(spec.layers):
        g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + layer)
        raw = torch.randint(0, 256, (spec.num_slots, spec.block_nbytes), generator=g, dtype=torch.uint8)
        cache = raw.view(DTYPES[spec.dtype]).view(spec.num_slots, *spec.block_shape)
        if layer == 0 and spec.all_bf16_patterns:
            flat = cache.view(-1)
            if spec.dtype != "bfloat16" or flat.numel() < 65536:
                raise ValueError("all_bf16_patterns needs a bfloat16 layer of >= 65536 elements")
            flat[:65536].copy_(all_bf16_patterns())
        out[layer] = cache.to(device)
    return out


def all_bf16_patterns() -> torch.Tensor:
    """The 65,536 BF16 values, one per bit pattern, in pattern order."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def zero_caches(spec: LayoutSpec, device: str | torch.device = "cpu") -> dict[int, torch.Tensor]:
    return {layer: torch.zeros(spec.num_slots, *spec.block_shape, dtype=DTYPES[spec.dtype], device=device)
            for layer in range(spec.layers)}


def check_loaded(caches: Mapping[Any, torch.Tensor], request: Mapping[int, Any],
                 expected: Mapping[int, Mapping[Any, torch.Tensor]]) -> int:
    """Compare loaded slots byte for byte with the sources' caches (keys = source slots).
    Returns the number of blocks checked; raises AssertionError on the first mismatch."""
    n = 0
    for src, layers in request.items():
        for layer, blocks in layers.items():
            for key, slots in blocks.items():
                want = expected[src][layer][int(key)].cpu().view(torch.uint8)
                for slot in (slots if isinstance(slots, (list, tuple)) else [slots]):
                    got = caches[layer][slot].cpu().view(torch.uint8)
                    if not torch.equal(got, want):
                        raise AssertionError(f"block {key!r} from rank {src} layer {layer} "
                                             f"differs in slot {slot}")
                    n += 1
    return n


def check_requests(caches: Mapping[Any, torch.Tensor], requests: Sequence[Mapping[int, Any]],
                   expected: Mapping[int, Mapping[Any, torch.Tensor]]) -> int:
    """Every block of every request (one slot per key) against the sources' known bytes,
    one comparison per (request, layer), so the temporaries stay under one batch; on a
    mismatch, the first wrong block is named (:func:`check_loaded`). Returns the number of
    blocks checked."""
    n = 0
    for req in requests:
        for src, layers in req.items():
            for layer, blocks in layers.items():
                cache = caches[layer]
                got = cache[torch.tensor(list(blocks.values()), device=cache.device)].cpu()
                want = expected[src][layer][torch.tensor(list(blocks))]
                if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                    check_loaded(caches, req, expected)
                    raise AssertionError(f"blocks from rank {src} layer {layer} differ")  # pragma: no cover
                n += len(blocks)
    return n


async def replay_loads(ep: Any, requests: Sequence[Any], concurrency: int) -> tuple[list[float], float]:
    """Run the requests on ``ep`` (an :class:`~xavier_async.Endpoint`) with ``concurrency``
    workers taking them in order; per-load seconds (in request order) and the wall time."""
    import anyio

    lat = [0.0] * len(requests)
    todo = iter(range(len(requests)))
    perf = time.perf_counter

    async def worker() -> None:
        for i in todo:
            t = perf()
            await ep.load(requests[i])
            lat[i] = perf() - t

    t0 = perf()
    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, len(requests))):
            tg.start_soon(worker)
    return lat, perf() - t0


async def replay_open_loop(ep: Any, requests: Sequence[Any], rate: float,
                           seed: int = 0) -> tuple[list[float], float]:
    """Run the requests on ``ep`` open loop: request ``i`` starts at its arrival time, the
    arrivals a Poisson process of ``rate`` per second (seeded), whether or not the loads
    before it are done. Per-load seconds from its arrival to its end (queueing included:
    a late start counts), and the wall time."""
    import random

    import anyio

    rng = random.Random(seed)
    at, t = [], 0.0
    for _ in requests:
        t += rng.expovariate(rate)
        at.append(t)
    lat = [0.0] * len(requests)
    perf = time.perf_counter

    async def one(i: int, t0: float) -> None:
        await ep.load(requests[i])
        lat[i] = perf() - (t0 + at[i])

    t0 = perf()
    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            delay = t0 + at[i] - perf()
            if delay > 0:
                await anyio.sleep(delay)
            tg.start_soon(one, i, t0)
    return lat, perf() - t0


def split_caches(spec: LayoutSpec, published: int, rank: int, seed: int, device: str | torch.device = "cpu",
                 ) -> dict[int, torch.Tensor]:
    """Caches of ``spec.num_slots`` slots: the low ``published`` hold
    ``pattern_caches(spec with num_slots=published, rank, seed)``, the rest are zeros."""
    if not 0 < published <= spec.num_slots:
        raise ValueError(f"published must be in 1..{spec.num_slots}, got {published}")
    caches = zero_caches(spec, device)
    for layer, t in pattern_caches(replace(spec, num_slots=published), rank, seed, device).items():
        caches[layer][:published].copy_(t)
    return caches


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (copied to the host)."""
    import hashlib
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def zero_slots(caches: Mapping[Any, torch.Tensor], request: Mapping[int, Any]) -> None:
    """Zero the destination slots of a request (so a check cannot pass on stale bytes)."""
    for layers in request.values():
        for layer, blocks in layers.items():
            for slots in blocks.values():
                for slot in (slots if isinstance(slots, (list, tuple)) else [slots]):
                    caches[layer][slot].zero_()


@dataclass
class PeerSpec:
    rank: int
    layout: LayoutSpec = field(default_factory=LayoutSpec)
    seed: int = 0
    device: str = "cpu"
    config: dict[str, Any] = field(default_factory=dict)
    transport: dict[str, Any] = field(default_factory=dict)
    cuda_visible: str | None = None
    #: torch intra-op threads in the child (1 avoids oversubscribing small CPU machines)
    torch_threads: int | None = None
    #: pin the child to these CPUs (``os.sched_setaffinity``)
    cpus: list[int] | None = None
    #: command prefix, e.g. ``["ip", "netns", "exec", "ns1"]`` to run it on another "host"
    wrapper: list[str] | None = None
    #: extra environment variables for the child (e.g. ``UCX_TLS``)
    env: dict[str, str] | None = None
    #: extra hello fields (the benchmark's consent to raw copies, for example)
    hello_extras: dict[str, Any] = field(default_factory=dict)
    #: a :class:`FaultPlan`'s fields: wrap the child's transport in a FaultyTransport
    faults: dict[str, Any] | None = None
    #: only the low ``published`` slots hold the pattern and are published; the slots
    #: above are zeros, the destination of ``replay`` (None: every slot, no replay)
    published: int | None = None


def _child(conn: Any, spec_d: dict[str, Any]) -> None:
    spec = PeerSpec(**{**spec_d, "layout": LayoutSpec(**spec_d["layout"])})
    import anyio

    from .. import Endpoint, EndpointConfig, _internal
    from ..transports.nixl import NixlTransport
    from .invariants import task_crashes

    if os.environ.get("XAVIER_ASYNC_CHILD_LOG"):  # e.g. "DEBUG": the child's log on stderr
        import logging
        logging.basicConfig(level=os.environ["XAVIER_ASYNC_CHILD_LOG"].upper(),
                            format=f"[rank {spec.rank}] %(levelname)s %(name)s: %(message)s")
        import faulthandler
        import signal
        faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: every thread's stack
    if spec.torch_threads is not None:
        torch.set_num_threads(spec.torch_threads)
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))

    host_profile = None
    if env_flag(HOST_PROFILE_ENV):  # the bench's --serving-host-profile (strict: "0" is off)
        host_profile = HostProfile().install()
    timeline = Timeline().install() if env_flag(TIMELINE_ENV) else None  # --load-timeline

    async def main() -> None:
        published = spec.layout.num_slots if spec.published is None else spec.published
        caches = (pattern_caches(spec.layout, spec.rank, spec.seed, spec.device) if spec.published is None
                  else split_caches(spec.layout, published, spec.rank, spec.seed, spec.device))
        transport: Any = NixlTransport(**spec.transport)
        if spec.faults:
            from .faulty import FaultPlan, FaultyTransport
            transport = FaultyTransport(transport, FaultPlan(**spec.faults))
        ep = Endpoint(spec.rank, caches, transport, EndpointConfig(**spec.config))
        _internal.hello_extras(ep).update(spec.hello_extras)
        async with ep:
            for slot in range(published):
                ep.publish(slot, slot)
            conn.send(("ok", ep.address))

            async def load(arg: Any) -> Any:
                request, src_seed = arg
                zero_slots(caches, request)
                r = await ep.load(request)
                expected = {src: pattern_caches(spec.layout, src, src_seed) for src in request}
                return asdict(r), check_loaded(caches, request, expected)

            async def recv_digest(nbytes: Any) -> str:
                assert ep.recv_slab is not None
                return digest(ep.recv_slab.tensor[:nbytes])

            async def publish_blocks(arg: Any) -> dict[str, Any]:
                """``{"keys": [...], "slots": [...]}``: the slots get their pattern back,
                are published, then zeroed (the engine reuses them at once: loads must
                still see the published bytes, from the snapshot store). With
                ``"seeds": [...]`` (one per key) slot ``slots[i]`` gets its pattern of
                ``pattern_caches(layout, rank, seeds[i])`` instead, so that two keys
                published from one slot hold different bytes."""
                keys, slots = list(arg["keys"]), list(arg["slots"])
                seeds = arg.get("seeds")
                if seeds is None:
                    fresh = pattern_caches(spec.layout, spec.rank, spec.seed, spec.device)
                    for layer, t in caches.items():
                        t[slots] = fresh[layer][slots]
                else:
                    if len(seeds) != len(keys):
                        raise ValueError("publish_blocks: one seed per key")
                    for slot, seed in zip(slots, seeds):
                        fresh = pattern_caches(spec.layout, spec.rank, int(seed), spec.device)
                        for layer, t in caches.items():
                            t[slot] = fresh[layer][slot]
                r = await ep.publish_blocks(keys, slots)
                for t in caches.values():
                    t[slots] = 0
                return asdict(r)

            async def peers(_: Any) -> list[int]:
                return list(ep.peers)

            async def metrics(_: Any) -> dict[str, Any]:
                return ep.snapshot_metrics()

            async def crashes(_: Any) -> int:
                """How many of this endpoint's background tasks crashed (a bug each)."""
                return task_crashes(ep)

            async def transport_stats(_: Any) -> dict[str, Any]:
                """The NIXL transport's own counts: ``stalls_seen``, the stalls its poll
                loop noticed (each followed by a sweep of the peers' streams; 0 with
                ``stall_check=0``); ``pieces``: (copies posted in pieces, pieces posted);
                ``bulk_posts``: WRITEs posted through its bulk agent."""
                inner = getattr(transport, "inner", transport)  # under a FaultyTransport
                return {"stalls_seen": inner.stalls_seen, "pieces": list(inner.pieces),
                        "bulk_posts": inner.bulk_posts}

            # the requests of the last replay, checked (then their slots zeroed) by check_replay
            replayed: list[Any] = []
            expected: dict[int, dict[int, torch.Tensor]] = {}

            async def replay(arg: Any) -> dict[str, Any]:
                """``{"requests": [...], "concurrency": n}``: loads into slots >= published,
                ``n`` in flight; per-load seconds and the wall time. Bytes: check_replay."""
                if spec.published is None:
                    raise ValueError("replay needs PeerSpec.published (a destination region)")
                requests = arg["requests"]
                for req in requests:
                    for layers in req.values():
                        for blocks in layers.values():
                            if min(blocks.values()) < published:
                                raise ValueError("replay loads only into slots >= published")
                replayed[:] = requests
                lat, wall = await replay_loads(ep, requests, int(arg["concurrency"]))
                return {"latencies": lat, "wall": wall}

            async def check_replay(_: Any) -> dict[str, int]:
                """Check every block of the last replay against its source's pattern (the
                sources' published layout is this one's), then zero the destination slots."""
                for src in {s for req in replayed for s in req}:
                    if src not in expected:
                        expected[src] = pattern_caches(replace(spec.layout, num_slots=published), src, spec.seed)
                blocks = check_requests(caches, replayed, expected)
                for t in caches.values():
                    t[published:].zero_()
                if spec.device.startswith("cuda"):  # zeroed before the next replay writes there
                    torch.cuda.synchronize(torch.device(spec.device))
                n, replayed[:] = len(replayed), []
                return {"loads": n, "blocks": blocks}

            async def host_time(reset: Any) -> dict[str, Any] | None:
                """The host-time profile since its last reset (then reset it, if asked);
                None when this process runs without one."""
                if host_profile is None:
                    return None
                out = host_profile.snapshot()
                if reset:
                    host_profile.reset()
                return out

            async def marks(_: Any) -> list[Any] | None:
                """The timeline's marks since the last call (None without one)."""
                return None if timeline is None else timeline.take()

            await serve_commands(conn, {"connect": ep.connect, "load": load, "host_time": host_time,
                                        "timeline": marks,
                                        "publish_blocks": publish_blocks,
                                        "recv_digest": recv_digest, "peers": peers,
                                        "metrics": metrics, "task_crashes": crashes,
                                        "transport_stats": transport_stats,
                                        "replay": replay,
                                        "check_replay": check_replay})

    try:
        anyio.run(main)
    except Exception as exc:
        send_error(conn, exc)


class PeerProcess:
    """A child process holding one NIXL endpoint. Blocking calls; use from a thread or
    with ``anyio.to_thread.run_sync`` inside async code."""

    def __init__(self, spec: PeerSpec, start_timeout: float = 60.0) -> None:
        self.spec = spec
        env = dict(spec.env or {})
        if spec.cuda_visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible
        self._child = ChildProcess("xavier_async.testing.peer_main", [json.dumps(asdict(spec))],
                                   f"peer process (rank {spec.rank})", env=env, wrapper=spec.wrapper)
        self.proc = self._child.proc
        try:
            self.address: str = self._child.reply(start_timeout)
        except BaseException:
            self.kill()
            raise

    def call(self, cmd: str, arg: Any = None, timeout: float = 60.0) -> Any:
        return self._child.call(cmd, arg, timeout)

    def task_crashes(self, timeout: float = 10.0) -> int:
        """How many of the child endpoint's background tasks crashed so far (each one a
        bug: :func:`~xavier_async.testing.invariants.task_crashes`)."""
        return int(self.call("task_crashes", None, timeout))

    def kill(self) -> None:
        """SIGKILL: the peer dies without closing anything."""
        self._child.kill()

    def close(self, timeout: float = 30.0) -> None:
        self._child.close(("close", None), timeout)

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

