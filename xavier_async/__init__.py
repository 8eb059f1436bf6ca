"""xavier_async: move KV-cache blocks between serving replicas over NIXL, through
persistent pre-registered slabs, with every peer channel driven by a state machine.

:class:`NixlTransport` is importable from here but imported lazily, on first use, so that
``import xavier_async`` does not load NIXL."""

from typing import TYPE_CHECKING, Any

from .channel import PeerChannel
from .endpoint import Endpoint, EndpointConfig, LoadResult, PeerWatcher
from .errors import (AllocationError, EndpointClosedError, HandshakeError, IntegrityError, InternalError,
                     InvalidRequestError, LayoutMismatchError, ListenError, PeerLostError,
                     RegistrationError, RemoteError,
                     StaleRequestError, TransferError, UnknownPeerError, XavierError)
from .layout import ALL_LAYERS
from .metrics import EndpointMetrics, PeerMetrics
from .policy import ChannelPolicy, build_machine
from .retry import RetryPolicy
from .sizes import SlabSizes
from .snapshots import PublishResult
from .transports import LocalFabric, LocalTransport, Transport

if TYPE_CHECKING:
    from .transports.nixl import NixlTransport

__version__ = "0.1.0"

__all__ = [
    "ALL_LAYERS", "ChannelPolicy", "build_machine", "Endpoint", "EndpointConfig", "LoadResult", "PeerWatcher",
    "PeerChannel", "RetryPolicy", "EndpointMetrics", "PeerMetrics",
    "Transport", "LocalFabric", "LocalTransport", "NixlTransport", "SlabSizes", "PublishResult",
    "XavierError", "InvalidRequestError", "LayoutMismatchError", "UnknownPeerError",
    "EndpointClosedError", "RegistrationError", "TransferError", "PeerLostError",
    "RemoteError", "HandshakeError", "ListenError", "IntegrityError", "InternalError",
    "StaleRequestError", "AllocationError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "NixlTransport":  # keep `import xavier_async` free of the NIXL import cost
        from .transports.nixl import NixlTransport
        return NixlTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
