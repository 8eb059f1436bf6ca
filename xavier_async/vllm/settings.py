"""The connector's settings: ``kv_connector_extra_config`` parsed and checked (pure).

The keys ``rank``, ``listen`` and ``peers`` are the contract every replica is configured
by; the others have defaults. Anything wrong raises :class:`InvalidRequestError` naming
the key, before an endpoint, a socket or a thread exists."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .._checks import check_bool, check_int
from ..errors import InvalidRequestError

MiB: Final = 1 << 20
#: how loads run: inside the step that needs them, or between steps (see docs/integration.md)
LOAD_MODES: Final = ("sync", "async")
#: ``direct_write_regions`` a replica whose KV caches are host memory serves with when the
#: key is left out: inside an engine the gather into a send slab is the engine's own CPU
#: time (docs/benchmarks.md, "Direct writes from the snapshot store inside vLLM")
HOST_DIRECT_WRITE_REGIONS: Final = 64
_KEYS: Final = frozenset({
    "rank", "listen", "peers", "secret", "verify", "load_mode", "snapshot_bytes",
    "host_snapshot_bytes", "connect_timeout", "load_timeout", "min_load_blocks", "stats_file",
    "poll_hot_window", "idle_poll", "prefault_snapshots", "direct_write_regions"})


@dataclass(frozen=True)
class ConnectorSettings:
    """What one replica's :class:`~xavier_async.vllm.XavierConnector` is told."""

    #: unique per replica (the endpoint's rank; every TP worker of the replica shares it)
    rank: int
    #: this replica's endpoint, ``host:port`` (TP worker ``t`` listens on ``port + t``)
    listen: str
    #: the other replicas' ``listen`` addresses (they may start later, in any order)
    peers: tuple[str, ...] = ()
    #: shared secret for the handshake (required by NIXL beyond loopback)
    secret: str | None = None
    #: check a digest of every batch (slower; catches corruption on the wire)
    verify: bool = False
    #: ``"sync"``: a load runs inside the step that needs it, before the forward;
    #: ``"async"``: the request waits for it between steps (``WAITING_FOR_REMOTE_KVS``)
    load_mode: str = "sync"
    #: the snapshot store's tier on the caches' device (published blocks are copied here)
    snapshot_bytes: int = 256 * MiB
    #: the store's host tier (``None``: the library's default; 0: none)
    host_snapshot_bytes: int | None = None
    #: seconds one connect attempt to a peer may take
    connect_timeout: float = 2.0
    #: seconds a peer has to answer a load before it is declared lost
    load_timeout: float = 5.0
    #: loads shorter than this many blocks are not worth a round trip (computed instead)
    min_load_blocks: int = 1
    #: where each worker writes its stats as JSON after a step that changed them and
    #: after each announcement it receives (``{tp}`` is replaced by the TP rank); for
    #: tests and benchmarks; ``None``: nowhere
    stats_file: str | None = None
    #: seconds the endpoint's poller keeps spinning after a copy or a message (0: it
    #: never spins past an empty poll). Inside an engine every spin takes the GIL and the
    #: core from the forward: 0.05 (the library's default) doubled B's TTFT (36 ms against
    #: 18 ms for a 1,024-token load, docs/benchmarks.md)
    poll_hot_window: float = 0.0
    #: seconds the idle poller sleeps between polls (the latency a peer's request waits)
    idle_poll: float = 0.0005
    #: touch the snapshot store's pages at start (``EndpointConfig.snapshot_prefault``):
    #: a publish into untouched DRAM paid page faults every step (1.34 ms against 0.18 ms
    #: for 4 MiB), until the store had been filled once
    prefault_snapshots: bool = True
    #: a serve from the snapshot store in at most this many regions is written straight
    #: from the store, with no gather (``EndpointConfig.direct_write_regions``; 0: always
    #: gather). ``None``: :data:`HOST_DIRECT_WRITE_REGIONS` (64) for caches in host memory,
    #: where a decoding replica kept 0.64-0.67 of its decode alone while a peer loaded its
    #: prefixes at 563-610 MB/s, against 0.62-0.64 at 459-472 MB/s with gathers (its pack
    #: 78 us against 3.0-3.3 ms a 4 MiB load); the library's default (2) on a GPU, where
    #: the gather is a kernel, not CPU time
    direct_write_regions: int | None = None

    def direct_write_regions_for(self, device_type: str) -> int | None:
        """The ``EndpointConfig.direct_write_regions`` for caches on ``device_type``
        (``None``: the library's default there)."""
        if self.direct_write_regions is not None:
            return self.direct_write_regions
        return HOST_DIRECT_WRITE_REGIONS if device_type == "cpu" else None

    @property
    def host(self) -> str:
        return split_address(self.listen)[0]

    @property
    def port(self) -> int:
        return split_address(self.listen)[1]

    def listen_of(self, tp_rank: int) -> str:
        """Where TP worker ``tp_rank`` of this replica listens."""
        return _shift(self.listen, tp_rank)

    def peers_of(self, tp_rank: int) -> tuple[str, ...]:
        """Where TP worker ``tp_rank`` of each peer listens (same TP rank: see the docs)."""
        return tuple(_shift(p, tp_rank) for p in self.peers)

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """``kv_connector_extra_config`` -> settings; :class:`InvalidRequestError` names
        the first key that is missing, unknown or malformed."""
        if extra is None or not isinstance(extra, Mapping):
            raise InvalidRequestError("XavierConnector needs kv_connector_extra_config with "
                                      "'rank', 'listen' and 'peers'")
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise InvalidRequestError(f"XavierConnector: unknown kv_connector_extra_config key(s) "
                                      f"{unknown}; known: {sorted(_KEYS)}")
        for key in ("rank", "listen"):
            if key not in extra:
                raise InvalidRequestError(f"XavierConnector: kv_connector_extra_config['{key}'] "
                                          "is required")
        rank = check_int("kv_connector_extra_config['rank']", extra["rank"], minimum=0)
        listen = _address("listen", extra["listen"])
        peers_in = extra.get("peers", [])
        if isinstance(peers_in, str) or not isinstance(peers_in, (list, tuple)):
            raise InvalidRequestError("XavierConnector: kv_connector_extra_config['peers'] must "
                                      f"be a list of 'host:port' strings, got {peers_in!r}")
        peers = tuple(_address("peers", p) for p in peers_in)
        if listen in peers:
            raise InvalidRequestError(f"XavierConnector: 'peers' names this replica's own "
                                      f"'listen' address {listen!r}")
        if len(set(peers)) != len(peers):
            raise InvalidRequestError(f"XavierConnector: 'peers' names an address twice: {peers}")
        secret = extra.get("secret")
        if secret is not None and (not isinstance(secret, str) or not secret):
            raise InvalidRequestError("XavierConnector: 'secret' must be a non-empty string")
        verify = check_bool("kv_connector_extra_config['verify']", extra.get("verify", False))
        mode = extra.get("load_mode", "sync")
        if mode not in LOAD_MODES:
            raise InvalidRequestError(f"XavierConnector: 'load_mode' must be one of {LOAD_MODES}, "
                                      f"got {mode!r}")
        snap = check_int("kv_connector_extra_config['snapshot_bytes']",
                         extra.get("snapshot_bytes", 256 * MiB), minimum=0)
        host_snap = _optional_count("host_snapshot_bytes", extra.get("host_snapshot_bytes"))
        return cls(rank, listen, peers, secret, verify, mode, snap, host_snap,
                   _seconds("connect_timeout", extra.get("connect_timeout", 2.0)),
                   _seconds("load_timeout", extra.get("load_timeout", 5.0)),
                   check_int("kv_connector_extra_config['min_load_blocks']",
                             extra.get("min_load_blocks", 1), minimum=1),
                   _path(extra.get("stats_file")),
                   _seconds("poll_hot_window", extra.get("poll_hot_window", 0.0), zero=True),
                   _seconds("idle_poll", extra.get("idle_poll", 0.0005)),
                   check_bool("kv_connector_extra_config['prefault_snapshots']",
                              extra.get("prefault_snapshots", True)),
                   _optional_count("direct_write_regions", extra.get("direct_write_regions")))


def _optional_count(key: str, value: Any) -> int | None:
    """An optional key's int >= 0 (``None``: left out, the default applies)."""
    if value is None:
        return None
    return check_int(f"kv_connector_extra_config['{key}']", value, minimum=0)


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (an IPv6 host in brackets) -> (host, port 1-65535)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or len(port) > 5 \
            or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
        raise ValueError("expected 'host:port' with a port from 1 to 65535")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _address(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"XavierConnector: '{key}' must be a 'host:port' string, "
                                  f"got {value!r}")
    try:
        host, port = split_address(value)
    except ValueError as exc:
        raise InvalidRequestError(f"XavierConnector: '{key}' must be 'host:port', got {value!r} "
                                  f"({exc})") from None
    return _join(host, port)


def _shift(address: str, by: int) -> str:
    host, port = split_address(address)
    if port + by > 65535:
        raise InvalidRequestError(f"XavierConnector: {address} + TP rank {by} is not a port")
    return _join(host, port + by)


def _path(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidRequestError(f"XavierConnector: 'stats_file' must be a path, got {value!r}")
    return value


def _seconds(key: str, value: Any, *, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value == float("inf") or not (value >= 0 if zero else value > 0):
        raise InvalidRequestError(f"XavierConnector: '{key}' must be a number of seconds "
                                  f"{'>= 0' if zero else '> 0'}, got {value!r}")
    return float(value)


__all__ = ["ConnectorSettings", "LOAD_MODES"]
