"""A fake NIXL agent for unit tests of :class:`NixlTransport` without NIXL.

Agents of one :class:`FakeFabric` live in one process: a WRITE really copies the bytes
(``ctypes.memmove`` between the registered buffers) and its notification lands in the peer's
inbox. ``fabric.hold_copies = True`` makes copies stay ``PROC`` until :meth:`FakeAgent.finish`
is called, and the agent records misuse (a handle released while a copy on it is posted,
a handle used after release) in ``errors``, so tests can assert there was none.
"""

from __future__ import annotations

import ctypes
import threading
from collections import defaultdict
from typing import Any


class FakeHandle:
    def __init__(self, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]],
                 agent: str) -> None:
        self.local, self.remote, self.agent = local, remote, agent
        self.state = "INIT"
        self.notif = b""
        self.released = False


class FakeFabric:
    def __init__(self) -> None:
        self.agents: dict[str, FakeAgent] = {}
        self.hold_copies = False
        #: inboxes are shared with a bulk agent's thread (xavier_async.transports.nixl_bulk)
        self.lock = threading.Lock()

    def factory(self, name: str, backends: list[str]) -> FakeAgent:
        agent = FakeAgent(self, name)
        self.agents[name] = agent
        return agent


class FakeAgent:
    def __init__(self, fabric: FakeFabric, name: str) -> None:
        self.fabric, self.name = fabric, name
        self.registered: list[Any] = []
        self.remotes: set[str] = set()
        self.added: list[str] = []  # every add_remote_agent, in order
        self.live: set[FakeHandle] = set()
        self.released: list[FakeHandle] = []
        self.posted: set[FakeHandle] = set()
        self.inbox: dict[str, list[bytes]] = defaultdict(list)
        self.errors: list[str] = []

    # memory
    def get_reg_descs(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> Any:
        return list(descs)

    def register_memory(self, descs: Any) -> Any:
        self.registered.append(descs)
        return descs

    def deregister_memory(self, reg: Any) -> None:
        self.registered.remove(reg)

    # agents
    def get_agent_metadata(self) -> bytes:
        return b"fake-agent:" + self.name.encode()

    def get_partial_agent_metadata(self, descs: Any, inc_conn_info: bool, backends: list[str]) -> bytes:
        return self.get_agent_metadata()  # (a registration added later: the same agent)

    def add_remote_agent(self, metadata: bytes) -> bytes:
        name = metadata.removeprefix(b"fake-agent:").decode()
        if name not in self.fabric.agents:
            raise RuntimeError(f"unknown agent {name}")
        self.remotes.add(name)
        self.added.append(name)
        return name.encode()

    def remove_remote_agent(self, agent: str) -> None:
        self.remotes.discard(agent)

    # transfers
    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem_type: str) -> Any:
        return list(descs)

    def initialize_xfer(self, op: str, local: Any, remote: Any, agent: str) -> FakeHandle:
        assert op == "WRITE"
        if agent not in self.remotes:
            raise RuntimeError(f"{agent} is not a remote agent of {self.name}")
        assert [d[1] for d in local] == [d[1] for d in remote], "lengths differ"
        h = FakeHandle(local, remote, agent)
        self.live.add(h)
        return h

    def _land(self, h: FakeHandle) -> None:
        for (src, n, _), (dst, _, _) in zip(h.local, h.remote):
            ctypes.memmove(dst, src, n)
        h.state = "DONE"
        self.posted.discard(h)
        if h.notif:
            with self.fabric.lock:
                self.fabric.agents[h.agent].inbox[self.name].append(h.notif)

    def transfer(self, handle: FakeHandle, notif: bytes = b"") -> str:
        if handle.released:
            self.errors.append("transfer on a released handle")
            return "ERR"
        if handle in self.posted:
            self.errors.append("transfer on a handle with a copy still posted")
            return "ERR"
        if notif:  # as NIXL does: an empty message re-sends the handle's last one
            handle.notif = notif
        handle.state = "PROC"
        self.posted.add(handle)
        if not self.fabric.hold_copies:
            self._land(handle)
        return handle.state

    def finish(self) -> None:
        """Land every held copy."""
        for h in list(self.posted):
            self._land(h)

    def check_xfer_state(self, handle: FakeHandle) -> str:
        return handle.state

    def release_xfer_handle(self, handle: FakeHandle) -> None:
        if handle in self.posted:
            self.errors.append("released a handle whose copy is still posted")
        handle.released = True
        self.live.discard(handle)
        self.released.append(handle)

    # notifications
    def send_notif(self, agent: str, msg: bytes) -> None:
        with self.fabric.lock:
            self.fabric.agents[agent].inbox[self.name].append(msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self.fabric.lock:
            out = {k: v for k, v in self.inbox.items() if v}
            self.inbox = defaultdict(list)
        return out
