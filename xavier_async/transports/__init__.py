"""Transport plugins: in-process (:class:`LocalTransport`) and NIXL (:class:`NixlTransport`,
imported lazily). The fault-injecting transport is test support: :mod:`xavier_async.testing`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Transport, TransportHost
from .local import LocalFabric, LocalTransport

if TYPE_CHECKING:
    from .nixl import NixlTransport

__all__ = ["Transport", "TransportHost", "LocalFabric", "LocalTransport", "NixlTransport"]


def __getattr__(name: str) -> Any:
    if name == "NixlTransport":  # keep `import xavier_async` free of the NIXL import cost
        from .nixl import NixlTransport
        return NixlTransport
    raise AttributeError(name)
