"""Exceptions raised by xavier_async.

Every error a caller can act on has its own class; all derive from :class:`XavierError`.
Input errors also derive from :class:`ValueError` so generic handlers keep working.
"""

from __future__ import annotations


class XavierError(Exception):
    """Base class of every xavier_async error."""


class InvalidRequestError(XavierError, ValueError):
    """A load request, size, budget or tensor was rejected before any byte moved."""


class LayoutMismatchError(InvalidRequestError):
    """Two endpoints (or a cache and its published layout) disagree on block shape or dtype."""


class UnknownPeerError(XavierError, KeyError):
    """The peer rank is not connected to this endpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown peer"


class EndpointClosedError(XavierError, RuntimeError):
    """The endpoint is closing or closed and takes no new work."""


class RegistrationError(XavierError):
    """Mapping a slab view with the transport failed after every retry.

    The failure is never cached: the next caller tries again.
    """


class TransferError(XavierError):
    """A copy failed in the transport. The peer's channel was reset."""


class PeerLostError(TransferError):
    """The peer went away (process died, connection closed, or it stopped answering)."""


class IntegrityError(TransferError):
    """A batch arrived with bytes that do not match the digest its source computed
    (``EndpointConfig(verify=True)``); it was not unpacked."""


class RemoteError(XavierError):
    """The source endpoint refused a load (for example an unpublished block key)."""


class StaleRequestError(RemoteError):
    """The source refused a request sent under an older epoch of the connection (the
    receiver had already given up on it)."""


class InternalError(XavierError, RuntimeError):
    """A broken invariant inside the library (a bug, never the caller's input). The loads
    it concerns fail with it and it is logged with context; the endpoint keeps serving
    everything else and never raises it out of ``async with``."""


class HandshakeError(XavierError):
    """Connecting to a peer failed: bad address, version or layout mismatch, or the peer
    refused or turned the connection away.

    :attr:`reason` says which, where it is known:

    * ``"busy"``: the peer had too many handshakes pending (from everyone, or from our
      address) and turned us away before reading anything. Transient: ``connect`` retries
      it with short backoff until its own timeout, and raises it only when that ran out.
    * ``"refused"``: the peer refused this handshake and said why (the message): a secret,
      version or slab-size mismatch, a rank held by another agent, a late frame. Retrying
      the same connect will not help until that is fixed.
    * ``"unreachable"``: nothing accepted a connection at the address.
    * ``"timeout"``: the handshake did not finish within the connect timeout.
    * ``"closed"``: the peer hung up during the handshake without saying why (it may have
      been stopping, or is not an xavier_async endpoint).
    * ``"address"``: the address is malformed (expected ``host:port``).
    * ``None``: anything else.
    """

    #: why the handshake failed (see the class docstring); ``None`` when unknown
    reason: str | None = None

    def __init__(self, *args: object, reason: str | None = None) -> None:
        super().__init__(*args)
        self.reason = reason


class AllocationError(XavierError, MemoryError):
    """The endpoint could not allocate its slabs or its snapshot store (the memory asked
    for is not there); raised by ``async with Endpoint`` before anything is registered,
    naming the setting (``full_bytes``, ``snapshot_gpu_bytes``, ``snapshot_cpu_bytes``)
    and the size, with the allocator's error chained as ``__cause__``."""


class ListenError(XavierError, OSError):
    """The endpoint could not listen on its ``host:port`` (the port is in use, or the host
    is not an address of this machine); raised by ``async with Endpoint`` before anything
    started, with the operating system's error chained as ``__cause__``. Pick another port
    (0 picks a free one) or another host. It is an ``OSError`` too, with the cause's
    ``errno``, so generic handlers keep working."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno
