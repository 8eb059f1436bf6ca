"""Addresses of the NIXL transport's TCP side: parsing ``host:port``, checking a host to
listen on, whether it is loopback only, and who is at the other end of a stream.

Pure functions over strings and sockets; every caller-facing failure is a typed error
(:class:`HandshakeError` ``reason="address"`` for a peer address, or
:class:`InvalidRequestError` for a listen host).
"""

from __future__ import annotations

import ipaddress
import socket

import anyio
from anyio.abc import SocketStream

from ..errors import HandshakeError, InvalidRequestError


def parse_address(address: object) -> tuple[str, int]:
    """``"host:port"`` (or ``"nixl://host:port"``; an IPv6 host in brackets,
    ``"[::1]:7000"``) -> (host, port). The port is 1-65535 in ASCII digits, the host a
    host name or an IP address; anything else is a :class:`HandshakeError` with
    ``reason="address"``, raised before anything is dialled."""

    def bad(why: str) -> HandshakeError:
        return HandshakeError(f"bad peer address {address!r}: {why}; expected 'host:port' (an "
                              "IPv6 host in brackets: '[::1]:7000')", reason="address")

    if not isinstance(address, str):
        raise bad("not a string")
    host, sep, port = address.removeprefix("nixl://").rpartition(":")
    if not sep or not host:
        raise bad("no host")
    if not (port.isascii() and port.isdigit()) or len(port) > 5 or not 0 < int(port) < 65536:
        raise bad("the port must be a number from 1 to 65535")
    if host.startswith("[") or host.endswith("]") or ":" in host:  # IPv6
        if host.startswith("[") != host.endswith("]"):
            raise bad("unbalanced brackets")
        host = host[1:-1] if host.startswith("[") else host
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad("a host with ':' must be an IPv6 address") from None
        return host, int(port)
    if any(c.isspace() or not c.isprintable() for c in host):
        raise bad("the host contains spaces or control characters")
    try:
        host.encode("idna")
    except UnicodeError:
        raise bad("not a valid host name") from None
    return host, int(port)


def check_host(name: str, host: object) -> str:
    """A host name or IP address to listen on or advertise: a non-empty string without
    spaces or control characters (an IPv6 address may be bracketed)."""
    if not isinstance(host, str) or not host.strip("[]"):
        raise InvalidRequestError(f"{name} must be a non-empty host name or IP address string "
                                  f"such as '127.0.0.1', got {host!r}")
    if any(c.isspace() or not c.isprintable() for c in host):
        raise InvalidRequestError(f"{name} must be a host name or IP address, got {host!r} "
                                  "(it contains spaces or control characters)")
    return host


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address) is reachable from this machine only."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def remote_host(stream: SocketStream) -> str:
    """The peer's IP address (what the per-host pre-authentication cap counts by)."""
    try:
        addr = stream.extra(anyio.abc.SocketAttribute.remote_address)
        return str(addr[0]) if isinstance(addr, tuple) else str(addr)
    except (anyio.TypedAttributeLookupError, ValueError, TypeError, IndexError):
        return "?"


def remote_address(stream: SocketStream) -> str:
    """The peer's ``ip:port`` (for log lines)."""
    try:
        addr = stream.extra(anyio.abc.SocketAttribute.remote_address)
        return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
    except (anyio.TypedAttributeLookupError, ValueError, TypeError):
        return "?"
