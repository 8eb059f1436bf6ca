"""The NIXL library as the NIXL transport uses it: the part of an agent's API it calls
(:class:`NixlAgent`, which a fake agent implements in unit tests), how the real agent is
built (:func:`nixl_agent_factory`: progress thread off, we poll), and NIXL's logging.

**Logging.** When its Python package is imported, NIXL configures its ``nixl`` logger
itself: INFO and above, printed to stdout by a handler of its own that bypasses the
application's logging (``propagate=False``), so every program that starts an endpoint
would print NIXL's "Backend UCX was instantiated" and "Initialized NIXL agent" lines.
Before the first agent is made, :func:`adopt_nixl_logging` hands that logger to the
application's logging instead: NIXL's handler is removed and its records propagate like
any library's. Quiet by default (Python shows warnings and errors only, on stderr);
visible with the application's logging config (``logging.basicConfig(level=logging.INFO)``
shows NIXL's INFO lines). Setting ``NIXL_LOG_LEVEL`` (``INFO``, ``WARN``, ...) opts out:
NIXL then logs as it configures itself, at that level (its C++ core reads the variable
too; at its default it prints nothing below warnings). ``xavier-async -v`` sets
``NIXL_LOG_LEVEL=INFO``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import InvalidRequestError

#: NIXL's own log level (read by NIXL's Python package and its C++ core); set, it means
#: the user chose NIXL's own logging and :func:`adopt_nixl_logging` leaves it alone
LOG_LEVEL_ENV = "NIXL_LOG_LEVEL"


class NixlAgent(Protocol):
    """The part of ``nixl._api.nixl_agent`` this transport uses (a fake one stands in for
    it in unit tests: ``NixlTransport(agent_factory=...)``)."""

    def get_reg_descs(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> Any: ...
    def register_memory(self, descs: Any) -> Any: ...
    def deregister_memory(self, reg: Any) -> None: ...
    def get_agent_metadata(self) -> bytes: ...
    def add_remote_agent(self, metadata: bytes) -> str | bytes: ...
    def remove_remote_agent(self, agent: str) -> None: ...
    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem_type: str) -> Any: ...
    def initialize_xfer(self, op: str, local: Any, remote: Any, agent: str) -> Any: ...
    def transfer(self, handle: Any, notif: bytes = b"") -> str: ...
    def check_xfer_state(self, handle: Any) -> str: ...
    def release_xfer_handle(self, handle: Any) -> None: ...
    def send_notif(self, agent: str, msg: bytes) -> None: ...
    def get_new_notifs(self) -> dict[Any, list[bytes]]: ...


#: builds the agent: (agent name, backends) -> agent
AgentFactory = Callable[[str, "list[str]"], NixlAgent]


def nixl_agent_factory(name: str, backends: list[str]) -> NixlAgent:
    """The real NIXL agent, progress thread off (we poll); NIXL's logs go to the
    application's logging unless ``NIXL_LOG_LEVEL`` is set (:func:`adopt_nixl_logging`)."""
    return _agent(name, backends, threaded=False)


def nixl_bulk_agent_factory(name: str, backends: list[str]) -> NixlAgent:
    """The bulk agent (:mod:`.nixl_bulk`): as :func:`nixl_agent_factory`, with NIXL's
    ``STRICT`` thread sync (two threads call it)."""
    return _agent(name, backends, threaded=True)


def _agent(name: str, backends: list[str], threaded: bool) -> NixlAgent:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    adopt_nixl_logging()
    sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if threaded else None
    agent: NixlAgent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=backends,
                                                          sync_mode=sync))
    made = getattr(agent, "backends", None)
    if isinstance(made, dict):
        missing = [b for b in backends if b not in made]
        if missing:
            raise InvalidRequestError(
                f"NixlTransport(backends={tuple(backends)!r}): NIXL has no plugin for "
                f"{missing}; the plugins it has: {sorted(getattr(agent, 'plugin_list', ()))}")
    return agent


_adopted = False


def adopt_nixl_logging() -> bool:
    """Hand NIXL's ``nixl`` logger to the application's logging (see the module): once
    per process, only if ``NIXL_LOG_LEVEL`` is not set and the logger is still as NIXL
    configured it (its level INFO, not propagating, its one console handler); a logger
    the application configured itself is left alone. Returns whether it changed it."""
    global _adopted
    if _adopted or os.environ.get(LOG_LEVEL_ENV):
        return False
    _adopted = True
    logger = logging.getLogger("nixl")
    handlers = logger.handlers
    if logger.propagate or logger.level != logging.INFO or len(handlers) != 1 \
            or handlers[0].get_name() != "consoleHandler":
        return False
    logger.removeHandler(handlers[0])
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    return True


def nixl_version() -> str:
    """The installed NIXL's version (``"?"`` when it cannot be told)."""
    import nixl
    try:
        from importlib.metadata import version
        return version("nixl")
    except Exception:
        return str(getattr(nixl, "__version__", "?"))
