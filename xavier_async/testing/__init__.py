"""Test support for stacks built on xavier_async (like ``trio.testing``): nothing here is
imported by the engine.

* :class:`FaultyTransport` / :class:`FaultPlan`: a transport wrapper that injects
  registration failures, copy failures, lost peers and delays, deterministically from a seed;
* :class:`PeerProcess` / :class:`PeerSpec`: an endpoint in a child process over real NIXL,
  with caches filled from a seed (:func:`pattern_caches`) so either side can check the
  bytes it loaded (:func:`check_loaded`);
* :class:`HostProfile`: where an event loop's host time goes, per callback and per engine
  function (asyncio; what ``xavier-async bench --serving-host-profile`` reports);
* :mod:`xavier_async.testing.chaos`: seeded chaos schedules over real NIXL processes
  (``run_schedule(seed)``), with the slab invariants of
  :func:`xavier_async.testing.invariants.check_slab_invariants`.
"""

from .faulty import FaultPlan, FaultyTransport
from .hostprof import HostProfile
from .peer_process import (LayoutSpec, PeerProcess, PeerSpec, all_bf16_patterns, check_loaded,
                           digest, pattern_caches, zero_caches, zero_slots)

__all__ = ["FaultPlan", "FaultyTransport", "HostProfile", "LayoutSpec", "PeerProcess", "PeerSpec",
           "all_bf16_patterns", "check_loaded", "digest", "pattern_caches", "zero_caches",
           "zero_slots"]
