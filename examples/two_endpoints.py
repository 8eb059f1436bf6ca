"""Two endpoints in one process: rank 1 loads KV blocks that rank 0 published."""
import anyio
import torch

from xavier_async import Endpoint, EndpointConfig, LocalFabric


async def main() -> None:
    fabric = LocalFabric()                      # in-process "network"
    config = EndpointConfig(full_bytes=1 << 20)  # 1 MiB slab, 256 KiB small view
    src = {layer: torch.randn(64, 16, 128) for layer in range(4)}   # [slots, *block]
    dst = {layer: torch.zeros(64, 16, 128) for layer in range(4)}
    async with Endpoint(0, src, fabric.transport(), config) as a, \
               Endpoint(1, dst, fabric.transport(), config) as b:
        peer = await b.connect(a.address)       # handshake: both ends learn each other
        a.publish("prefix-hash-7", slot=3)      # block 3 of every layer is loadable
        result = await b.load({peer: {layer: {"prefix-hash-7": 10} for layer in src}})
        for layer in src:                        # the bytes arrived, bit for bit
            assert torch.equal(dst[layer][10], src[layer][3])
        print(f"loaded {result.blocks} blocks in {result.batches} batch(es): "
              f"{result.useful_bytes} useful B, {result.wire_bytes} B on the wire")


anyio.run(main)
