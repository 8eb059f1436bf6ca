"""Who may start a handshake with a NIXL endpoint, before it knows who they are.

* **The secret** (:func:`resolve_secret`): a listener beyond loopback needs a shared
  secret (``secret=`` or ``XAVIER_ASYNC_SECRET``) unless the network is declared trusted
  (``insecure=`` or ``XAVIER_ASYNC_INSECURE``); the handshake proves it on both ends
  (:mod:`.handshake`).
* **Pre-authentication slots** (:class:`Admission`): a connection holds a slot from its
  accept until the peer's hello passed (or the handshake ended). At most
  ``max_unauthenticated`` slots are held at once, and at most
  ``max_unauthenticated_per_host`` by one remote address; a connection beyond either cap
  is told "busy" and closed at once (:meth:`Admission.turn_away`), and a connecting
  xavier_async endpoint retries it. A slot's holder must send its first frame within
  ``first_frame_timeout`` and each later one, up to its hello, within ``step_timeout``.

So silent or slow strangers cannot lock real peers out (docs/threat-model.md).
"""

from __future__ import annotations

import os

import anyio
from anyio.abc import SocketStream

from .._checks import check_bool, check_int, check_number, env_flag
from ..errors import InvalidRequestError
from .addresses import is_loopback
from .handshake import FrameStream, busy, refusal

#: environment variables: the shared secret, and "1" to listen beyond loopback without one
SECRET_ENV = "XAVIER_ASYNC_SECRET"
INSECURE_ENV = "XAVIER_ASYNC_INSECURE"


def resolve_secret(secret: str | bytes | None, insecure: bool | None,
                   host: str) -> tuple[bytes | None, bool]:
    """The secret and the insecure flag a listener on ``host`` runs with (the environment
    fills what the caller left ``None``). Refuses (:class:`InvalidRequestError`) a secret
    shorter than 16 bytes, and listening beyond loopback with neither a secret nor
    ``insecure``."""
    if insecure is None:
        insecure = env_flag(INSECURE_ENV)
    check_bool("insecure", insecure)
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if isinstance(secret, str):
        secret = secret.encode()
    if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
        raise InvalidRequestError(f"secret must be str or bytes of at least 16 bytes "
                                  f"(got {type(secret).__name__} of {len(secret) if isinstance(secret, bytes) else '?'}); "
                                  "for example: python -c 'import secrets; print(secrets.token_hex(32))'")
    if secret is None and not insecure and not is_loopback(host):
        raise InvalidRequestError(
            f"refusing to listen on {host!r} without a secret: anyone who can reach that port "
            f"could read every published block and write into this endpoint's receive slab. "
            f"Pass secret= (or set {SECRET_ENV}) on every endpoint, or insecure=True (or "
            f"{INSECURE_ENV}=1) if the network is trusted")
    return secret, insecure


class Admission:
    """The pre-authentication slots of one listener: how many handshakes are pending, in
    all and by remote address, and the deadlines their steps run under.

    Every setting is validated here (:class:`InvalidRequestError` naming it); the
    per-address cap is at most the total."""

    def __init__(self, *, first_frame_timeout: float = 2.0, step_timeout: float = 1.0,
                 max_total: int = 64, max_per_host: int = 8) -> None:
        #: seconds for a new connection's first handshake frame, and for each later one
        #: up to its hello (a late step frees its slot at once)
        self.first_frame_timeout = check_number("first_frame_timeout", first_frame_timeout,
                                                strictly_positive=True)
        self.step_timeout = check_number("preauth_step_timeout", step_timeout, strictly_positive=True)
        self.max_total = check_int("max_unauthenticated", max_total, minimum=1)
        self.max_per_host = min(check_int("max_unauthenticated_per_host", max_per_host, minimum=1),
                                self.max_total)
        #: handshakes accepted whose peer has not passed its hello yet, in all and by host
        self.pending = 0
        self.by_host: dict[str, int] = {}
        #: connections turned away at once ("busy" refusal) because ``max_total``
        #: handshakes, or ``max_per_host`` from that host, were pending
        self.refused = 0

    def busy(self, who: str) -> str | None:
        """Why a new connection from ``who`` is turned away now, or ``None``."""
        if self.pending >= self.max_total:
            return (f"{self.pending} handshakes are pending at this endpoint "
                    f"(max_unauthenticated={self.max_total}); try again shortly")
        mine = self.by_host.get(who, 0)
        if mine >= self.max_per_host:
            return (f"{mine} handshakes from {who} are pending at this endpoint "
                    f"(max_unauthenticated_per_host={self.max_per_host}); "
                    "try again shortly")
        return None

    def take(self, who: str) -> None:
        """A connection from ``who`` holds a slot (after :meth:`busy` said ``None``)."""
        self.pending += 1
        self.by_host[who] = self.by_host.get(who, 0) + 1

    def release(self, who: str) -> None:
        """Give back a slot that ``who`` held."""
        self.pending -= 1
        left = self.by_host.get(who, 0) - 1
        if left > 0:
            self.by_host[who] = left
        else:
            self.by_host.pop(who, None)

    async def turn_away(self, stream: SocketStream, why: str) -> None:
        """Tell a connection we will not serve now why (a "busy" refusal frame, which its
        ``connect`` retries), then close it, and count it in :attr:`refused`. Bounded: a
        fresh socket's send buffer takes the small frame at once, and nothing is read."""
        self.refused += 1
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(0.05):
                try:
                    await FrameStream(stream).send(refusal(busy(why)))
                except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass
            await stream.aclose()
