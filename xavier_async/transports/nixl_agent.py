"""The NIXL library as the NIXL transport uses it: the part of an agent's API it calls
(:class:`NixlAgent`, which a fake agent implements in unit tests), how the real agent is
built (:func:`nixl_agent_factory`: progress thread off, we poll) and its version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


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
    """The real NIXL agent, progress thread off (we poll)."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent: NixlAgent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=backends))
    return agent


def nixl_version() -> str:
    """The installed NIXL's version (``"?"`` when it cannot be told)."""
    import nixl
    try:
        from importlib.metadata import version
        return version("nixl")
    except Exception:
        return str(getattr(nixl, "__version__", "?"))
