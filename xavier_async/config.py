"""An endpoint's settings (:class:`EndpointConfig`) and what one load moved
(:class:`LoadResult`): plain, validated values (pure: no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._checks import check_bool, check_int, check_number, check_size
from .errors import InvalidRequestError
from .policy import DEFAULT_STREAK
from .retry import RetryPolicy
from .sizes import DEFAULT_FULL_BYTES, MiB, SlabSizes

#: the host tier's default when none is given: this much, at most an eighth of the host
DEFAULT_HOST_TIER_BYTES = 1 << 30
#: ``direct_write_regions`` when it is left to the default and the caches are on a GPU
GPU_DIRECT_WRITE_REGIONS = 2


def direct_write_regions_for(value: int | None, device_type: str) -> int:
    """``EndpointConfig.direct_write_regions`` as the source applies it to caches on
    ``device_type`` (``"cpu"``, ``"cuda"``): ``None`` picks what the figures support there."""
    if value is not None:
        return value
    return GPU_DIRECT_WRITE_REGIONS if device_type == "cuda" else 0


def default_host_tier_bytes() -> int:
    """``min(1 GiB, physical memory / 8)``: the host tier's default budget."""
    import os
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return DEFAULT_HOST_TIER_BYTES
    return int(min(DEFAULT_HOST_TIER_BYTES, phys // 8))


#: the longest ``EndpointConfig.reply_spin`` (seconds the event loop may be held)
MAX_REPLY_SPIN = 0.01


@dataclass(frozen=True)
class EndpointConfig:
    """Tuning knobs, all validated at construction.

    ``full_bytes``/``small_bytes``: the slab and its small prefix view (small defaults to
    ``min(full, 256 KiB)``); both are also available as one validated value, ``sizes``.
    ``streak``: consecutive small batches before the small view is used (1 = size-only
    selection). ``trimmed``: copy only the payload rounded up to ``trim_align`` instead of
    the whole chosen view. ``request_timeout``: how long a receiver waits for a batch it
    requested (queueing at the source, packing and the copy) before declaring the source
    lost; keep it above the transport's own copy timeout (NIXL: 30 s), so a source whose
    copy stalls reports the failure itself first. ``stream_ordered_unpack``: on CUDA, let
    :meth:`Endpoint.load` return once the unpack is enqueued on the caches' current stream
    instead of waiting for it (saves a device synchronization per batch). ``verify``:
    every batch this endpoint loads carries a digest of its payload, computed by the
    source after packing (on the device for VRAM); the batch is checked before it is
    unpacked, and a mismatch raises :class:`IntegrityError` instead of writing it (costs a
    reduction over the payload on both ends).

    ``reply_spin``: seconds a load's round trip polls for its reply from its own call
    stack (the transport's notifications, delivered as its poller would, requests to
    serve included) before waiting for it through the event loop. Only a small batch
    that is this endpoint's only request in flight spins, and only over a transport that
    sends and polls synchronously (NIXL): a one-hash load then never waits for an event
    loop pass (on the 2-core machine, ~35 us less host time). The event loop is held for
    at most this long; 0 turns it off.

    ``receive_slabs`` (K) and ``send_slabs`` (S): the slab pools. Each slab is allocated
    and registered once at start (S + K memory registrations, none after); each batch
    borrows one receive slab for its round trip, each copy a source serves one send slab
    until the copy is terminal, so up to K batches load and up to S copies are served at
    once. Head-of-line rule: a batch whose payload exceeds the small view may hold at most
    K - 1 receive slabs (and S - 1 send slabs) at once, so one of each is always left for
    small batches, which never wait behind a whole large copy. With a pool of one slab
    there is no reservation (K = S = 1 is the one-batch-at-a-time design). When every
    slab is busy, a load waits (back-pressure, never an error).

    ``map_eagerly``: when a peer joins, map every (send slab, view, peer's receive slab)
    pair for it in the background (2 x S x K mappings per peer, made at once), so that no
    copy ever waits for a mapping and registrations are flat from the first load on. Off
    (the default), mappings are made on first use, at most 2 x S x K per peer, and only
    those that traffic needs (one-at-a-time traffic needs two).

    ``merge_loads``: batches from one source that wait for a receive slab are merged into
    one request, one copy and one unpack (:mod:`xavier_async.merging`): small batches up
    to the small view (the group stays small under the head-of-line rule), large ones up
    to the full slab. Nothing merges while a slab is free, so an unloaded endpoint's loads
    are unchanged; under load, a round trip serves every batch that waited for it. A
    member cancelled before its group's request goes out takes nothing; after that it is
    copied but not unpacked. A source that refuses a merged request (an unpublished key)
    is asked again batch by batch, so only the loads naming the missing keys fail.

    ``merge_small_bytes``: how large a group of waiting small batches may grow (default,
    and minimum: the small view; at most the full slab). Above the small view a group
    makes fewer, larger round trips, but it is a large batch everywhere after it forms:
    the channel machine copies it through the full view (the whole slab unless
    ``trimmed``, and a following small batch starts a new streak) and the source serves
    it under the large batches' share of send slabs. It keeps its small place in the
    receive-slab queue. When it pays and when it does not (measured): docs/concepts.md.

    ``small_round_trips`` (opt in, needs ``merge_loads``): at most this many round trips
    of small batches in flight to one source. A small batch that finds them all busy
    waits in its source's forming group, which goes out when one of them ends (and a
    receive slab is free), so loaded traffic makes fewer, fuller round trips while the
    other slabs stay free for large batches. ``None`` (the default): no cap, a small batch
    takes any free slab. A cancelled batch waiting for a round trip takes nothing. Why,
    and what it measured: docs/concepts.md.

    ``snapshot_gpu_bytes`` / ``snapshot_cpu_bytes``: the budgets of the snapshot store's
    two tiers (:mod:`xavier_async.snapshots`), on by default as in the seed's deployment
    (256 MiB of device memory per replica there). Published blocks are copied out of the
    engine's slots into them, so the engine may reuse a slot as soon as publishing
    returns; the device tier (GPU memory on CUDA; DRAM on CPU caches) spills its least
    recently used blocks into the host tier (DRAM, pinned on CUDA). The host tier defaults
    to ``min(1 GiB, physical memory / 8)``: host memory is cheaper than device memory, its
    pages are touched only as blocks land there, and the seed's deployment served most
    warm batches from its CPU tier. Both 0: no store, blocks are served from the engine's
    live slots (zero copy, and the engine must not reuse a slot it published).

    ``snapshot_prefault``: touch every page of both tiers once at start (where they are
    host memory: CPU caches, or the host tier of CPU caches), so that no publish pays
    first-touch page faults. Measured on the 2-core machine: copying 4 MiB into untouched
    DRAM took 1.34 ms, into touched DRAM 0.18 ms, and a vLLM step's publish of 8 blocks
    paid that on every step until the store had been filled once. It costs one pass over
    the tiers at start (about 0.3 s a GiB there) and commits their memory at once. Off by
    default; the vLLM connector turns it on.

    ``direct_write_regions``: a serve from the store whose blocks lie in the store as at
    most this many contiguous regions of the device tier (one block over every layer is
    one region; the receive slab's layout is layer-major, so a batch of several blocks is
    one region per block and layer) is written straight from the store into the peer's
    receive slab, with no gather into a send slab (no source kernel); anything else is
    gathered with one pass, then written. A direct write moves
    exactly the payload (as ``trimmed`` does), whatever view the channel's machine chose.
    0: always gather. ``None`` (the default): 0 when the caches are host memory, where a
    direct write with a new transfer handle loses to the gather already at one region;
    :data:`GPU_DIRECT_WRITE_REGIONS` (2) when they are on a GPU, where on an H200 the
    direct write took 0.62x of the gather at one region and broke even at two to four
    (two runs), and the one-hash serve's ``pack`` + ``post_to_done`` fell to 0.71x of the
    live slots'. ``xavier-async bench --only-snapshot`` prints the rule for the machine it
    runs on (docs/benchmarks.md).

    ``copy_threads`` / ``copy_thread_bytes``: a pack or unpack of host memory (CPU caches)
    of at least ``copy_thread_bytes`` (default 1 MiB) runs on one of ``copy_threads``
    threads of the endpoint (default 2; 0: every copy runs on the event loop), so that
    small loads and serves go on while a large batch is copied (:mod:`xavier_async.copythreads`).
    A request that needs such a pack is served from the serve queue, never inline from
    the poller. The threads start on first use and are joined at close; a started copy
    is always waited for to its end. Copies of GPU memory are kernels and never use them.

    ``split_copies``: a host copy of at least twice ``copy_thread_bytes`` is cut into
    pieces of about equal bytes (at least ``copy_thread_bytes`` each), one for each copy
    thread, copied at once. Off by default: alone, one thread's scattered 12 MiB table
    ran at 3.3 GB/s on the 2-core machine and two at once at 7.0 GB/s, but in the serving
    bench there (three processes on two cores) the split took both cores from the small
    loads (open-loop small p99 16.8-17.1 ms against 7.5-11.2 ms) and left the stream as
    it was (0.35-0.36 of raw against 0.29-0.34).
    """

    full_bytes: int = DEFAULT_FULL_BYTES
    small_bytes: int | None = None
    streak: int = DEFAULT_STREAK
    trimmed: bool = False
    trim_align: int = 256
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    request_timeout: float = 60.0
    reply_spin: float = 0.0002
    stream_ordered_unpack: bool = False
    verify: bool = False
    receive_slabs: int = 4
    send_slabs: int = 4
    map_eagerly: bool = False
    merge_loads: bool = True
    merge_small_bytes: int | None = None
    small_round_trips: int | None = None
    snapshot_gpu_bytes: int = 256 * MiB
    snapshot_cpu_bytes: int | None = None
    snapshot_prefault: bool = False
    direct_write_regions: int | None = None
    copy_threads: int = 2
    copy_thread_bytes: int = 1 * MiB
    split_copies: bool = False
    sizes: SlabSizes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = SlabSizes.of(self.full_bytes, self.small_bytes)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "full_bytes", sizes.full)
        object.__setattr__(self, "small_bytes", sizes.small)
        object.__setattr__(self, "streak", check_int("streak", self.streak, minimum=1))
        object.__setattr__(self, "receive_slabs",
                           check_int("receive_slabs", self.receive_slabs, minimum=1, maximum=1024))
        object.__setattr__(self, "send_slabs",
                           check_int("send_slabs", self.send_slabs, minimum=1, maximum=1024))
        check_bool("trimmed", self.trimmed)
        check_bool("stream_ordered_unpack", self.stream_ordered_unpack)
        check_bool("verify", self.verify)
        check_bool("map_eagerly", self.map_eagerly)
        check_bool("snapshot_prefault", self.snapshot_prefault)
        check_bool("merge_loads", self.merge_loads)
        merge_small = sizes.small if self.merge_small_bytes is None else self.merge_small_bytes
        object.__setattr__(self, "merge_small_bytes", check_int(
            "merge_small_bytes", merge_small, minimum=sizes.small, maximum=sizes.full))
        if self.small_round_trips is not None:
            object.__setattr__(self, "small_round_trips", check_int(
                "small_round_trips", self.small_round_trips, minimum=1, maximum=1024))
            if not self.merge_loads:
                raise InvalidRequestError("small_round_trips needs merge_loads (the batches that "
                                          "wait for a round trip merge into the next one)")
        object.__setattr__(self, "snapshot_gpu_bytes", check_int(
            "snapshot_gpu_bytes", self.snapshot_gpu_bytes, minimum=0))
        host = default_host_tier_bytes() if self.snapshot_cpu_bytes is None else self.snapshot_cpu_bytes
        object.__setattr__(self, "snapshot_cpu_bytes", check_int("snapshot_cpu_bytes", host, minimum=0))
        if self.direct_write_regions is not None:
            object.__setattr__(self, "direct_write_regions", check_int(
                "direct_write_regions", self.direct_write_regions, minimum=0, maximum=4096))
        check_size("trim_align", self.trim_align)
        object.__setattr__(self, "copy_threads", check_int("copy_threads", self.copy_threads,
                                                           minimum=0, maximum=64))
        object.__setattr__(self, "copy_thread_bytes", check_size("copy_thread_bytes",
                                                                 self.copy_thread_bytes))
        check_bool("split_copies", self.split_copies)
        check_number("request_timeout", self.request_timeout, strictly_positive=True)
        object.__setattr__(self, "reply_spin", check_number("reply_spin", self.reply_spin,
                                                            maximum=MAX_REPLY_SPIN))
        if not isinstance(self.retry, RetryPolicy):
            raise InvalidRequestError("retry must be a RetryPolicy")


@dataclass(frozen=True)
class LoadResult:
    """What one :meth:`Endpoint.load` moved: ``batches`` planned, ``blocks`` and
    ``useful_bytes`` loaded, and ``wire_bytes`` copied for them (a batch merged with others
    into one copy, ``merge_loads``, is charged its share of that copy, by payload)."""

    batches: int
    blocks: int
    useful_bytes: int
    wire_bytes: int
    #: blocks the source served from its snapshot store's device and host tiers (the
    #: rest came from its live slots); a merged batch is charged its share
    device_tier_blocks: int = 0
    host_tier_blocks: int = 0


__all__ = ["EndpointConfig", "LoadResult", "default_host_tier_bytes", "GPU_DIRECT_WRITE_REGIONS", "MAX_REPLY_SPIN",
           "direct_write_regions_for"]
