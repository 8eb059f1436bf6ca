"""xavier_async: move KV-cache blocks between serving replicas over NIXL, through
persistent pre-registered slabs, with every peer channel driven by a state machine."""

from .channel import PeerChannel
from .endpoint import Endpoint, EndpointConfig, LoadResult
from .errors import (EndpointClosedError, HandshakeError, InvalidRequestError,
                     LayoutMismatchError, PeerLostError, RegistrationError, RemoteError,
                     TransferError, UnknownPeerError, XavierError)
from .metrics import EndpointMetrics, PeerMetrics
from .policy import ChannelPolicy, build_machine
from .retry import RetryPolicy
from .transports import LocalFabric, LocalTransport, Transport

__version__ = "0.1.0"

__all__ = [
    "ChannelPolicy", "build_machine", "Endpoint", "EndpointConfig", "LoadResult",
    "PeerChannel", "RetryPolicy", "EndpointMetrics", "PeerMetrics",
    "Transport", "LocalFabric", "LocalTransport",
    "XavierError", "InvalidRequestError", "LayoutMismatchError", "UnknownPeerError",
    "EndpointClosedError", "RegistrationError", "TransferError", "PeerLostError",
    "RemoteError", "HandshakeError", "__version__",
]
