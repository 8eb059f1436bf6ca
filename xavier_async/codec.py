"""Control messages between endpoints: one tag byte plus compact JSON (pure core).

JSON rather than pickle: a peer can never make us execute code. Block keys may be bytes,
which are tagged as ``{"b": hex}``.
"""

from __future__ import annotations

import json
from typing import Any

LOAD = b"L"      # receiver -> source: [req_id, batch wire]
LANDED = b"D"    # source -> receiver (with the write): [req_id, payload, view, wire bytes]
ERROR = b"E"     # source -> receiver: [req_id, kind, message]
MAGIC = b"XA"    # every control message starts with this, then the tag

_dumps = json.JSONEncoder(separators=(",", ":"), default=lambda o: {"b": o.hex()}).encode


def _hook(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and "b" in obj:
        return bytes.fromhex(obj["b"])
    return obj


_loads = json.JSONDecoder(object_hook=_hook).decode


def encode(tag: bytes, body: Any) -> bytes:
    return MAGIC + tag + _dumps(body).encode()


def decode(msg: bytes) -> tuple[bytes, Any]:
    """Split a message into (tag, body); raises ValueError on anything malformed."""
    if len(msg) < 3 or msg[:2] != MAGIC:
        raise ValueError(f"not an xavier_async control message: {msg[:16]!r}")
    try:
        return msg[2:3], _loads(msg[3:].decode())
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise ValueError(f"malformed control message: {exc!r}") from None


def is_control(msg: bytes) -> bool:
    return msg[:2] == MAGIC
