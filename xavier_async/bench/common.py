"""What every section of ``xavier-async bench`` shares: the options, the layout and the
serving trace, and the summary statistics. The sections (:mod:`.suite`, :mod:`.descriptors`,
:mod:`.serving`, :mod:`.snapshots`, :mod:`.xoscar_anchor`) import this module and none of
them imports another section back, so the bench has no import cycle
(``tests/test_architecture.py`` checks it)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import check_number
from ..config import MAX_REPLY_SPIN
from ..slabs import KiB, MiB
from ..testing.devices import peer_device
from ..testing.peer_process import LayoutSpec

PEER = 1
SEED_CASES = ("always_full", "alternating_size_only", "alternating_streak", "sustained_small")
TRACE_MODES = {  # name: (streak, trimmed)
    "padded_size_only": (1, False),
    "padded_streak": (2, False),
    "trimmed_streak": (2, True),
}


#: the options that are an int in a range or None (the engine's default):
#: (name, lowest, highest or None for no upper bound)
_OPTIONAL_INTS: tuple[tuple[str, int, int | None], ...] = (
    ("serving_slabs", 1, 1024),
    ("serving_small_trips", 1, 1024),
    ("serving_piece_bytes", 0, None),
    ("serving_bulk_bytes", 0, None),
    ("serving_copy_threads", 0, 64),
    ("serving_direct_write_regions", 0, 4096),
)


def _check_int(name: str, value: object, lowest: int, highest: int | None, *,
               optional: bool = False, span: str | None = None) -> None:
    """Raise ValueError unless ``value`` is an int from ``lowest`` to ``highest``
    (or None, where ``optional``); a bool is no int here."""
    if value is None and optional:
        return
    if type(value) is int and lowest <= value and (highest is None or value <= highest):
        return
    if span is None:
        span = f">= {lowest}" if highest is None else f"from {lowest} to {highest}"
    raise ValueError(f"{name} must be an int {span}, got {value!r}")


@dataclass
class BenchOptions:
    """What to run. ``quick`` shrinks every count for CI."""

    transport: str = "nixl"
    device: str = "auto"
    full_bytes: int = 12 * MiB
    small_bytes: int = 256 * KiB
    copies: int = 400
    warmup: int = 30
    loads: int = 300
    trace_batches: int = 628
    trace_large: int = 25
    alloc_copies: int = 10_000
    #: real loads for the memory-growth check over loads
    alloc_loads: int = 10_000
    #: run the packed-vs-descriptor section (NIXL transport only)
    descriptors: bool = True
    #: run the plain-Python protocol floor (:mod:`.protocol_floor`; NIXL transport only)
    protocol_floor: bool = True
    #: run the load timeline (:mod:`xavier_async.testing.timeline`: per side Python host
    #: time of one-hash loads, two processes of its own; NIXL transport only)
    load_timeline: bool = True
    #: run the snapshot-store section (:mod:`.snapshots`; NIXL transport only)
    snapshot: bool = True
    seed: int = 0
    quick: bool = False
    progress: bool = True
    #: pin this process and the peer to two different physical cores (>= 4 cores only);
    #: None: only on the CPU (pinned next to CUDA's and UCX's threads, a GPU run halves)
    pin_cpus: bool | None = None
    #: also run the seed's four cases through an anchor (``"xoscar"``: xoscar's copy_to
    #: over NIXL, two processes; needs ``pip install 'xavier-async[xoscar]'``)
    compare: str | None = None
    #: the serving-load section (16 loads in flight; NIXL only)
    serving: bool = True
    #: its topology: ``three`` (a loader and two sources), ``duplex`` (two endpoints that
    #: both load and serve), ``auto`` (duplex on CUDA, three on the CPU)
    serving_topology: str = "auto"
    #: the slab count compared with K=1 (receive and send slabs; None: the engine's default)
    serving_slabs: int | None = None
    #: ``merge_small_bytes`` of the merged serving runs (None: the engine's default)
    serving_merge_small: int | None = None
    #: ``small_round_trips`` of the merged serving runs (None: no cap, the engine's default)
    serving_small_trips: int | None = None
    #: the serving section's endpoints (every run) copy only the payload (``trimmed``)
    serving_trimmed: bool = False
    #: ``NixlTransport(piece_bytes=...)`` of every serving endpoint (None: its default;
    #: 0: every copy posted whole)
    serving_piece_bytes: int | None = None
    #: ``NixlTransport(bulk_bytes=...)`` of every serving endpoint (None: its default for
    #: the host's cores; 0: no WRITE through the bulk agent)
    serving_bulk_bytes: int | None = None
    #: ``EndpointConfig.copy_threads`` of every serving endpoint (None: the engine's default;
    #: 0: every host copy on the event loop)
    serving_copy_threads: int | None = None
    #: ``EndpointConfig.split_copies`` of every serving endpoint (True: each large host
    #: copy cut across the copy threads)
    serving_split_copies: bool = False
    #: ``EndpointConfig.direct_write_regions`` of every serving endpoint (None: the
    #: engine's default for the caches' device; 0: always gather)
    serving_direct_write_regions: int | None = None
    #: ``EndpointConfig.reply_spin`` of the load rows' endpoints (None: the engine's default)
    reply_spin: float | None = None
    #: count each serving process's host time per callback and engine function, per phase
    #: (:class:`~xavier_async.testing.hostprof.HostProfile`; asyncio only, adds overhead)
    serving_host_profile: bool = False
    #: rounds of the serving section's runs, alternated (each figure: the median over them)
    serving_rounds: int = 1

    def __post_init__(self) -> None:
        if self.transport not in ("nixl", "local"):
            raise ValueError(f"transport must be 'nixl' or 'local', got {self.transport!r}")
        if self.compare not in (None, "xoscar"):
            raise ValueError(f"compare must be None or 'xoscar', got {self.compare!r}")
        if self.serving_topology not in ("auto", "three", "duplex"):
            raise ValueError(f"serving_topology must be auto, three or duplex, got {self.serving_topology!r}")
        for name, lowest, highest in _OPTIONAL_INTS:
            _check_int(name, getattr(self, name), lowest, highest, optional=True)
        _check_int("serving_merge_small", self.serving_merge_small, self.small_bytes,
                   self.full_bytes, optional=True, span="from the small view to the full slab")
        if self.reply_spin is not None:  # (InvalidRequestError is a ValueError)
            check_number("reply_spin", self.reply_spin, maximum=MAX_REPLY_SPIN)
        _check_int("serving_rounds", self.serving_rounds, 1, 100)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        for name in ("full_bytes", "small_bytes", "copies", "warmup", "loads", "trace_batches",
                     "alloc_copies", "alloc_loads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.trace_large <= self.trace_batches:
            raise ValueError("trace_large must be between 0 and trace_batches")
        if self.small_bytes > self.full_bytes:
            raise ValueError("small_bytes must not exceed full_bytes")
        if self.quick:
            self.copies, self.warmup, self.loads = min(self.copies, 60), min(self.warmup, 10), min(self.loads, 40)
            self.trace_batches, self.trace_large = min(self.trace_batches, 126), min(self.trace_large, 5)
            self.alloc_copies = min(self.alloc_copies, 1000)
            self.alloc_loads = min(self.alloc_loads, 500)

    def resolved_pin(self) -> bool:
        """Whether to pin: as asked, else only when the run is on the CPU."""
        return self.pin_cpus if self.pin_cpus is not None else self.resolved_device() == "cpu"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        # CUDA only on a GPU pair: one GPU would time-slice the two processes
        return "cuda" if torch.cuda.is_available() and not peer_device(1, "cuda").shared else "cpu"


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of already sorted samples, by nearest rank."""
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def stats(samples: Sequence[float]) -> dict[str, float]:
    """Median, p95 and mean, in microseconds."""
    s = sorted(samples)
    return {"median_us": statistics.median(s) * 1e6, "p95_us": nearest_rank(s, 0.95) * 1e6,
            "mean_us": statistics.fmean(s) * 1e6, "n": len(s)}


# -- the serving-trace generator -----------------------------------------------------------
@dataclass(frozen=True)
class TraceBatch:
    keys: int      # block hashes in the batch
    layers: int    # layers per block hash
    large: bool


def bench_layout(full_bytes: int) -> LayoutSpec:
    """24 layers of 8 KiB blocks (a Qwen2.5-0.5B-like KV block: 2 x 16 tokens x 2 heads x 64,
    BF16), with enough slots for a full-slab batch plus as many destination slots."""
    spec = LayoutSpec(layers=24, num_slots=2, block_shape=(2, 16, 2, 64), dtype="bfloat16")
    keys_full = max(1, full_bytes // (spec.layers * spec.block_nbytes))
    return LayoutSpec(layers=24, num_slots=2 * keys_full, block_shape=(2, 16, 2, 64), dtype="bfloat16")


def make_trace(n: int, n_large: int, layout: LayoutSpec, full_bytes: int, small_bytes: int,
               seed: int) -> list[TraceBatch]:
    """Cold long prompts (near the full slab) scattered among warm short ones (a few
    layer-blocks, well under the small view), like the seed's deployment (628 batches:
    25 near 12 MiB, 603 small)."""
    rng = random.Random(seed)
    bn = layout.block_nbytes
    keys_full = max(1, full_bytes // (layout.layers * bn))
    small_max = max(1, min(layout.layers, small_bytes // bn // 2))
    large_at = set(rng.sample(range(n), n_large))
    out = []
    for i in range(n):
        if i in large_at:
            out.append(TraceBatch(rng.randint(max(1, keys_full - 4), keys_full), layout.layers, True))
        else:
            out.append(TraceBatch(1, rng.randint(2, small_max), False))
    return out


def trace_payload(b: TraceBatch, layout: LayoutSpec) -> int:
    return b.keys * b.layers * layout.block_nbytes


def target(value: float, limit: float, le: bool = True) -> dict[str, Any]:
    """One row of a target table: the value, its limit and whether it is met (``value <=
    limit``, or ``>=`` with ``le=False``)."""
    return {"value": value, "limit": limit, "met": value <= limit if le else value >= limit}


def use_device(o: BenchOptions) -> str:
    """Set this process up for the run's device (returned: ``cpu`` or ``cuda``)."""
    device = o.resolved_device()
    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        # Both endpoints poll NIXL on their event loop; torch's intra-op threads on top of
        # that oversubscribe a small CPU machine and turn microseconds into timeslices.
        torch.set_num_threads(1)
    return device
