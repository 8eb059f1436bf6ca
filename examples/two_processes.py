"""Two OS processes over NIXL: one publishes KV blocks, the other connects by address and loads them."""
import multiprocessing as mp

import anyio
import torch

from xavier_async import Endpoint, NixlTransport

SHAPE = (64, 2, 16, 64)                     # [num_slots, *block_shape], per layer


def kv_caches(seed: int) -> dict[int, torch.Tensor]:   # seeded, so both processes can rebuild it
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.randn(SHAPE, generator=g).bfloat16() for layer in range(4)}


def prefill(conn) -> None:                  # process 1, rank 0: holds the blocks
    async def serve() -> None:
        async with Endpoint(0, kv_caches(seed=7), NixlTransport()) as ep:  # 127.0.0.1, a free port
            ep.publish("block-42", slot=3)                  # after prefill
            conn.send(ep.address)                           # "host:port": pass it any way you like
            await anyio.to_thread.run_sync(conn.recv)       # serve until the loader is done
    anyio.run(serve)


async def decode(address: str) -> None:     # process 2, rank 1: loads them on a prefix hit
    dst = {layer: torch.zeros_like(t) for layer, t in kv_caches(seed=0).items()}
    async with Endpoint(1, dst, NixlTransport()) as ep:
        peer = await ep.connect(address)
        result = await ep.load({peer: {layer: {"block-42": 5} for layer in dst}})
    src = kv_caches(seed=7)
    for layer in dst:                       # bit for bit, every layer
        assert torch.equal(dst[layer][5].view(torch.int16), src[layer][3].view(torch.int16))
    print(f"loaded {result.blocks} blocks from another process over NIXL ({result.useful_bytes} B)")


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=prefill, args=(there,))
    child.start()
    there.close()                           # a dead child then reads as EOFError, not a hang
    try:
        anyio.run(decode, here.recv())
    finally:
        here.send("done")
        child.join()
    assert child.exitcode == 0, f"prefill process exited with {child.exitcode}"
