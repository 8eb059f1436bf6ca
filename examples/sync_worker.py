"""Driving endpoints from synchronous worker code (a vLLM-style connector) via an anyio
blocking portal: the endpoint lives on an event loop thread, the worker calls into it.

Two "workers" share one process here (and so one portal); in production each GPU worker
process has its own portal, endpoint and NixlTransport.
"""
from concurrent.futures import Future

import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from xavier_async import Endpoint, EndpointConfig, LoadResult, LocalFabric, Transport


class KVTransferWorker:
    """The worker half of a connector: one Endpoint per worker process."""

    def __init__(self, portal: BlockingPortal, rank: int, kv_caches: dict[str, torch.Tensor],
                 transport: Transport, config: EndpointConfig) -> None:
        # vLLM-style caches are [2, num_blocks, *block]: split K and V, slot dimension first
        caches = {}
        for name, kv in kv_caches.items():
            caches[f"{name}.k"], caches[f"{name}.v"] = kv[0], kv[1]
        self.portal = portal
        self.endpoint = Endpoint(rank, caches, transport, config)
        self._cm = portal.wrap_async_context_manager(self.endpoint)
        self._cm.__enter__()                                  # slabs allocated + registered

    @property
    def address(self) -> str:
        return self.endpoint.address

    def connect(self, address: str) -> int:
        return self.portal.call(self.endpoint.connect, address)

    def publish(self, block_hash: str, slot: int) -> None:   # after prefill filled the block
        self.portal.call(self.endpoint.publish, block_hash, slot)

    def unpublish(self, block_hash: str) -> None:            # before the slot is reused
        self.portal.call(self.endpoint.unpublish, block_hash)

    def start_load(self, peer: int, blocks: dict[str, int]) -> "Future[LoadResult]":
        """Prefix hit: load ``{block hash: local slot}`` from ``peer`` for every layer."""
        request = {peer: {layer: blocks for layer in self.endpoint.caches}}
        return self.portal.start_task_soon(self.endpoint.load, request)

    def close(self) -> None:                                  # drains in-flight copies
        self._cm.__exit__(None, None, None)


def main() -> None:
    fabric, config = LocalFabric(), EndpointConfig(full_bytes=1 << 20)
    layers = {f"layer{i}": torch.randn(2, 32, 16, 64) for i in range(2)}  # [K/V, blocks, ...]
    empty = {name: torch.zeros_like(kv) for name, kv in layers.items()}
    with start_blocking_portal() as portal:
        prefill = KVTransferWorker(portal, 0, layers, fabric.transport(), config)
        decode = KVTransferWorker(portal, 1, empty, fabric.transport(), config)
        try:
            peer = decode.connect(prefill.address)
            prefill.publish("h0", 5)
            prefill.publish("h1", 6)
            result = decode.start_load(peer, {"h0": 0, "h1": 1}).result(timeout=30)
            for name in layers:
                assert torch.equal(empty[name][:, 0], layers[name][:, 5])
                assert torch.equal(empty[name][:, 1], layers[name][:, 6])
            print(f"sync worker loaded {result.blocks} blocks ({result.useful_bytes} B)")
        finally:
            decode.close()                                    # receivers first, then sources
            prefill.close()


if __name__ == "__main__":
    main()
