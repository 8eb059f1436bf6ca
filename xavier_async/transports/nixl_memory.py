"""The NIXL transport's memory: what its agent has registered, and telling peers about
new receive slabs.

* Registrations: the send and receive slabs (the endpoint's pools) are registered once
  each, at start or when the pool grows (DRAM, or VRAM on the caches' GPU), and so are
  the snapshot tiers (:meth:`Memory.add_pool`: the pools a direct write reads). With a
  bulk agent (:mod:`.nixl_bulk`) the send slabs are registered with it too. Views and
  peers never register memory again; everything is deregistered at close.
* Sharing: a peer learns of our receive slabs in the handshake (their addresses in our
  hello). One added later (the pool's slabs 1.., a fenced slab's replacement) can be
  written by a peer's agent only once it holds that registration: :meth:`Memory.share`
  sends it (NIXL partial agent metadata) with the slab's address as a transport
  notification (prefix :data:`XT`) and waits for the acknowledgement;
  :meth:`Memory.on_message` is the other end (add the registration to our agents, record
  the address, acknowledge) and takes our acknowledgements.

The transport (:mod:`.nixl`) owns the agent and the peer table; it binds the agent here
at start, hands over its peer table (read only), counts the registrations, and routes
the notifications that start with :data:`XT` here.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ..errors import InternalError, InvalidRequestError, PeerLostError

if TYPE_CHECKING:
    import torch

    from ..slabs import Slab
    from .nixl_agent import NixlAgent

log = logging.getLogger("xavier_async.nixl")

#: prefix of the transport's own notifications (new receive slabs and their acks)
XT = b"XT:"


class Holder(Protocol):
    """A connected peer, as receive-slab sharing sees it (the transport's peer record)."""

    rank: int
    #: its NIXL agent's name
    agent: str
    #: its receive slabs we may write: index -> address
    recv_ptrs: dict[int, int]
    lost: bool
    #: our receive slabs it knows (their registrations reached its agent)
    told: set[int]


class Memory:
    """The registrations of one NIXL transport and the sharing of new receive slabs.
    ``counted`` is called after each registration (the transport's counter)."""

    def __init__(self, peers: Mapping[int, Holder], by_agent: Mapping[str, int],
                 backends: list[str], counted: Callable[[], None]) -> None:
        self._peers, self._by_agent = peers, by_agent
        self._backends = backends
        self._counted = counted
        self.agent: NixlAgent | None = None
        #: the bulk agent (:mod:`.nixl_bulk`), if any: it registers the send slabs too
        self.bulk: NixlAgent | None = None
        #: our memory's NIXL type and device (the slabs')
        self.mem, self.dev = "DRAM", 0
        self.device: torch.device | None = None
        #: every registration, deregistered at close (and the bulk agent's)
        self.regs: list[Any] = []
        self.bulk_regs: list[Any] = []
        #: registered pools (snapshot tiers): (first address, end, memory type, device)
        self.pools: list[tuple[int, int, str, int]] = []
        #: our send slabs by index
        self.send_slabs: dict[int, Slab] = {}
        #: receive slabs by index and their registrations
        self.recv_slabs: dict[int, Slab] = {}
        self.recv_regs: dict[int, Any] = {}
        #: receive slab indices whose registration is under way
        self.registering: set[int] = set()
        #: (peer agent, slab index) -> set when the peer acknowledged our new slab
        self.acks: dict[tuple[str, int], anyio.Event] = {}

    @property
    def _agent(self) -> NixlAgent:
        if self.agent is None:
            raise InternalError("the NIXL transport is used before start()")
        return self.agent

    # -- registrations -------------------------------------------------------------------
    def start(self, agent: NixlAgent, mem: str, dev: int, send: Slab, recv: Slab,
              bulk: NixlAgent | None = None) -> None:
        """The transport started: register its first send and receive slabs (the send
        slab with the bulk agent too)."""
        self.agent, self.mem, self.dev, self.device = agent, mem, dev, send.device
        self.bulk = bulk
        self.send_slabs[send.index] = send
        for slab in (send, recv):
            self.regs.append(agent.register_memory(self.reg_descs(slab)))
            self._counted()
        self._register_bulk(send)
        self.recv_slabs[recv.index] = recv
        self.recv_regs[recv.index] = self.regs[-1]

    def reg_descs(self, slab: Slab, agent: NixlAgent | None = None) -> Any:
        return (agent or self._agent).get_reg_descs(
            [(slab.tensor.data_ptr(), slab.full.nbytes, self.dev, "")], self.mem)

    def add_remote(self, meta: bytes) -> str:
        """Load a peer's (full or partial) agent metadata into our agents (the bulk agent
        writes into the peer's receive slabs too); the peer agent's name."""
        name = self._agent.add_remote_agent(meta)
        if self.bulk is not None:
            self.bulk.add_remote_agent(meta)
        return name.decode() if isinstance(name, bytes) else name

    def remove_remote(self, name: str) -> None:
        """Forget a peer's agent in our agents (a failure is logged: the peer is gone)."""
        for ours in (self.agent, self.bulk):
            if ours is None:
                continue
            try:
                ours.remove_remote_agent(name)
            except Exception:
                log.debug("remove_remote_agent failed", exc_info=True)

    def _register_bulk(self, slab: Slab) -> None:
        """A send slab, registered with the bulk agent as well (if there is one)."""
        if self.bulk is not None:
            self.bulk_regs.append(self.bulk.register_memory(self.reg_descs(slab, self.bulk)))
            self._counted()

    async def _register(self, slab: Slab) -> Any:
        """Register one more slab of the endpoint's (its device's) memory."""
        await anyio.lowlevel.checkpoint()
        if self.device is None or slab.device != self.device:
            raise InvalidRequestError(
                f"{'receive' if slab.direction == 'recv' else 'send'} slab on {slab.device}, "
                "not on the endpoint's device")
        reg = self._agent.register_memory(self.reg_descs(slab))
        self.regs.append(reg)
        self._counted()
        return reg

    async def add_send_slab(self, slab: Slab) -> None:
        await self._register(slab)
        self._register_bulk(slab)
        self.send_slabs[slab.index] = slab

    async def add_recv_slab(self, slab: Slab) -> None:
        """Register one more receive slab (refused before anything is registered when its
        index is taken or being registered)."""
        if slab.index in self.recv_slabs or slab.index in self.registering:
            raise InvalidRequestError(f"receive slab {slab.index} is already registered")
        self.registering.add(slab.index)  # claimed before the registration awaits
        try:
            self.recv_regs[slab.index] = await self._register(slab)
            self.recv_slabs[slab.index] = slab
        finally:
            self.registering.discard(slab.index)

    async def add_pool(self, memory: torch.Tensor) -> None:
        """Register a snapshot tier: VRAM on the caches' GPU, or DRAM (pinned on CUDA)."""
        await anyio.lowlevel.checkpoint()
        cuda = memory.device.type == "cuda"
        if cuda and (self.device is None or memory.device != self.device):
            raise InvalidRequestError(f"a snapshot tier on {memory.device}, not on the endpoint's device")
        agent = self._agent
        nbytes = memory.numel() * memory.element_size()
        mem, dev = ("VRAM", memory.device.index or 0) if cuda else ("DRAM", 0)
        reg = agent.register_memory(agent.get_reg_descs([(memory.data_ptr(), nbytes, dev, "")], mem))
        self.regs.append(reg)
        self.pools.append((memory.data_ptr(), memory.data_ptr() + nbytes, mem, dev))
        self._counted()

    def deregister_all(self) -> None:
        for agent, regs in ((self.agent, self.regs), (self.bulk, self.bulk_regs)):
            for reg in regs:
                try:
                    agent.deregister_memory(reg)  # type: ignore[union-attr]
                except Exception:
                    log.warning("deregister_memory failed", exc_info=True)
            regs.clear()

    # -- telling peers about new receive slabs -------------------------------------------
    async def share(self, p: Holder, slab: Slab, timeout: float) -> None:
        """Send the slab's registration (NIXL partial agent metadata) and address to the
        peer as a notification and wait up to ``timeout`` for its acknowledgement."""
        if slab.index in p.told:
            return
        if slab.index not in self.recv_regs:
            raise InvalidRequestError(f"receive slab {slab.index} is not registered")
        agent = self._agent
        meta = agent.get_partial_agent_metadata(self.reg_descs(slab), False, self._backends)  # type: ignore[attr-defined]
        key = (p.agent, slab.index)
        ack = self.acks[key] = anyio.Event()
        msg = XT + json.dumps({"slab": slab.index, "ptr": slab.tensor.data_ptr(),
                               "meta": base64.b64encode(meta).decode()}).encode()
        try:
            try:
                agent.send_notif(p.agent, msg)
            except Exception as exc:
                raise PeerLostError(f"cannot tell rank {p.rank} about receive slab {slab.index}: {exc}") from exc
            with anyio.move_on_after(timeout) as scope:
                await ack.wait()
            if scope.cancelled_caught or p.lost:
                raise PeerLostError(f"rank {p.rank} did not acknowledge receive slab {slab.index} "
                                    f"within {timeout} s")
        finally:
            self.acks.pop(key, None)
        p.told.add(slab.index)

    def on_message(self, agent: str, msg: bytes) -> None:
        """A transport-level notification from ``agent``: a peer's new receive slab, or
        our ack."""
        try:
            body = json.loads(msg[len(XT):])
            if "ack" in body:
                ev = self.acks.get((agent, int(body["ack"])))
                if ev is not None:
                    ev.set()
                return
            rank = self._by_agent.get(agent)
            p = self._peers.get(rank) if rank is not None else None
            if p is None or p.lost:
                return
            index, ptr = int(body["slab"]), int(body["ptr"])
            self.add_remote(base64.b64decode(body["meta"], validate=True))
            p.recv_ptrs[index] = ptr
            self._agent.send_notif(agent, XT + json.dumps({"ack": index}).encode())
        except Exception:
            log.warning("bad transport message from agent %s", agent, exc_info=True)
