"""Counters kept per endpoint and per peer. Plain ints: cheap on the hot path."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .stages import LoadStages


@dataclass
class PeerMetrics:
    """What one endpoint did with one peer.

    Writer side (this endpoint copied into the peer): ``batches_sent``, ``useful_bytes``,
    ``wire_bytes``, ``copies_full``, ``copies_small``, ``view_switches``, ``registrations``
    (view mappings made), ``retries``, ``failures``, ``resets``.
    Receiver side (this endpoint loaded from the peer): ``batches_received`` (copies),
    ``batches_merged`` (batches that rode in another batch's copy: ``merge_loads``),
    ``bytes_received``, ``load_errors``.
    """

    batches_sent: int = 0
    useful_bytes: int = 0
    wire_bytes: int = 0
    copies_full: int = 0
    copies_small: int = 0
    view_switches: int = 0
    registrations: int = 0
    retries: int = 0
    failures: int = 0
    resets: int = 0
    batches_received: int = 0
    batches_merged: int = 0
    bytes_received: int = 0
    load_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain ``{name: value}`` dict."""
        return asdict(self)


@dataclass
class EndpointMetrics:
    """Per-peer metrics plus the endpoint's own counters."""

    memory_registrations: int = 0
    loads: int = 0
    #: round trips that polled for their reply themselves (``EndpointConfig.reply_spin``),
    #: and those of them whose reply came within the spin (the others then waited for it
    #: through the event loop)
    reply_spins: int = 0
    replies_polled: int = 0
    peers: dict[int, PeerMetrics] = field(default_factory=dict)
    #: per-stage timing histograms of loads (receiver side) and served requests (source)
    stages: LoadStages = field(default_factory=LoadStages)

    def peer(self, rank: int) -> PeerMetrics:
        """The counters for ``rank``, created on first use."""
        m = self.peers.get(rank)
        if m is None:
            m = self.peers[rank] = PeerMetrics()
        return m

    def total(self) -> PeerMetrics:
        """Sum over peers."""
        out = PeerMetrics()
        for m in self.peers.values():
            for f in fields(PeerMetrics):
                setattr(out, f.name, getattr(out, f.name) + getattr(m, f.name))
        return out

    @property
    def registrations(self) -> int:
        """Memory registrations plus view mappings: flat after warm-up."""
        return self.memory_registrations + self.total().registrations

    def as_dict(self) -> dict[str, Any]:
        """Everything as plain dicts: endpoint counters, the per-peer sum, each peer, and
        the per-stage timings (:meth:`LoadStages.as_dict`)."""
        return {
            "memory_registrations": self.memory_registrations,
            "registrations": self.registrations,
            "loads": self.loads,
            "reply_spins": self.reply_spins,
            "replies_polled": self.replies_polled,
            "total": self.total().as_dict(),
            "peers": {rank: m.as_dict() for rank, m in sorted(self.peers.items())},
            "stages": self.stages.as_dict(),
        }
