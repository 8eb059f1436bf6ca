"""One serving replica of the demo, in its own process: a :class:`~xavier_async.demo.model.Runner`
(model + paged KV cache) and one :class:`~xavier_async.Endpoint` over NIXL whose caches are
the runner's slot tensors.

The driver sends it batches of requests over a pipe. Each request is an async task (at
most ``concurrency`` at once); model forwards run in ONE dedicated thread (one device, one
forward at a time, and on CUDA one cuBLAS handle and one stream, so results do not depend
on which thread ran a call), so loads of some requests overlap the forwards of others.
Three request modes:

* ``cold``: prefill the prompt's full blocks into slots, **publish** them, decode.
* ``load``: the driver found ``hits`` (a prefix of block hashes) on peer ``source``:
  **load** them into fresh slots, build the model's cache from those slots, prefill only
  the rest, decode; on any :class:`~xavier_async.XavierError` recompute the prefix instead.
* ``recompute``: prefill the same prefix blocks locally (same chunking as the owner), then
  the same steps. This is the reference every ``load`` request is compared against.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from ..testing.child import send_error, serve_commands
from .model import BLOCK, ModelShape, Runner

T = TypeVar("T")


class Replica:
    """The request handling of one replica (runs on the replica's event loop)."""

    def __init__(self, runner: Runner, endpoint: Any, conn: Connection, chunk_tokens: int) -> None:
        self.runner = runner
        self.ep = endpoint
        self.conn = conn
        self.chunk = chunk_tokens
        #: float32 on the CPU is compared bit for bit (free-running); BF16 with tolerance
        self.exact = runner.shape.torch_dtype == torch.float32 and runner.device.type == "cpu"
        self._model_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        #: request id -> (tokens, logits) of the recompute path (the reference)
        self.reference: dict[int, tuple[list[int], torch.Tensor]] = {}
        #: block hash -> digest of the bytes this replica computed for it
        self.block_digest: dict[str, str] = {}

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        # worker threads start on the default CUDA device: make ours current there
        if self.runner.device.type == "cuda":
            with torch.cuda.device(self.runner.device):
                yield
        else:
            yield

    def _submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        def call() -> T:
            with self._on_device():
                return fn(*args)
        return self._model_thread.submit(call)

    async def _model(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a model call on the model thread; a cancelled caller still waits for it."""
        import anyio
        return await anyio.to_thread.run_sync(self._submit(fn, *args).result)

    def warm_up(self) -> None:
        """One small prefill + decode, so the first timed request pays no start-up cost."""
        slots = self.runner.kv.alloc(2)
        tokens = list(range(2 * BLOCK + 3))

        def run() -> None:
            self.runner.prefill_blocks(tokens, slots, self.chunk)
            cache, first = self.runner.first_token(tokens, slots)
            self.runner.decode(cache, first, len(tokens), 2)
        self._submit(run).result()
        self.runner.kv.release(slots)

    # -- one batch of requests ------------------------------------------------------------
    async def run_batch(self, arg: dict[str, Any]) -> dict[str, Any]:
        import anyio
        mode: str = arg["mode"]
        cancel = set(arg.get("cancel", ()))
        gate = anyio.Semaphore(int(arg.get("concurrency", 16)))
        first_load = anyio.Event()
        results: list[dict[str, Any]] = []

        async def one(req: dict[str, Any]) -> None:
            async with gate:
                results.append(await self._request(req, mode, arg["new_tokens"],
                                                   req["id"] in cancel, first_load, tg))

        async def signal_loading() -> None:
            # failure injection: tell the driver that a load is in flight (it then kills the source)
            await first_load.wait()
            await anyio.sleep(0.2)
            self.conn.send(("event", "loading"))

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            if arg.get("signal_loading"):
                tg.start_soon(signal_loading)
            async with anyio.create_task_group() as reqs:
                for req in arg["requests"]:
                    reqs.start_soon(one, req)
            tg.cancel_scope.cancel()
        return {"wall_s": time.perf_counter() - t0,
                "requests": sorted(results, key=lambda r: int(r["id"]))}

    @staticmethod
    async def _cancel_soon(scope: Any) -> None:
        import anyio
        await anyio.lowlevel.checkpoint()
        scope.cancel()

    async def _request(self, req: dict[str, Any], mode: str, new_tokens: int, cancel: bool,
                       first_load: Any, side: Any) -> dict[str, Any]:
        import anyio

        from ..errors import XavierError
        kv = self.runner.kv
        tokens: list[int] = req["tokens"]
        hashes: list[str] = req["hashes"] if mode == "cold" else req["hits"]
        out: dict[str, Any] = {"id": req["id"], "mode": mode, "hits": len(hashes), "loaded": False,
                               "fallback": None, "cancelled": False}
        t0 = time.perf_counter()
        slots = kv.alloc(len(hashes))
        keep = False
        try:
            if mode == "load" and hashes:
                request = {req["source"]: {layer: dict(zip(hashes, slots)) for layer in kv.caches}}
                try:
                    with anyio.CancelScope() as scope:
                        if cancel:  # cancelled mid-load: the load is under way when this fires
                            side.start_soon(self._cancel_soon, scope)
                        first_load.set()
                        await self.ep.load(request)
                    out["loaded"] = not scope.cancelled_caught
                    if scope.cancelled_caught:
                        out["cancelled"] = True
                        out["latency_s"] = time.perf_counter() - t0
                        return out
                except XavierError as exc:
                    out["fallback"] = type(exc).__name__
            if not out["loaded"]:
                await self._model(self.runner.prefill_blocks, tokens, slots, self.chunk)
            if mode == "cold":
                for h, slot in zip(hashes, slots):
                    self.ep.publish(h, slot)  # after prefill: peers may load these blocks now
                out["published"] = list(zip(hashes, slots))
                keep = True
            digests = await self._model(lambda: [kv.digest(s) for s in slots])
            cache, first = await self._model(self.runner.first_token, tokens, slots)
            out["ttft_s"] = time.perf_counter() - t0
            # BF16: decode on the reference's tokens (teacher forcing), so that one step's
            # near-tie cannot turn every later step into a different continuation
            forced = self.reference.get(req["id"], (None, None))[0] \
                if mode == "load" and not self.exact else None
            gen, logits = await self._model(self.runner.decode, cache, first, len(tokens),
                                            new_tokens, forced)
            out["latency_s"] = time.perf_counter() - t0
            out["tokens"] = gen
            if mode == "recompute":
                self.reference[req["id"]] = (gen, logits)
                self.block_digest.update(zip(hashes, digests))
            elif mode == "load":
                out.update(self._compare(req["id"], gen, logits))
                known = [self.block_digest.get(h) for h in hashes]
                out["kv_equal"] = all(k == d for k, d in zip(known, digests)) if None not in known else None
            return out
        finally:
            if not keep:
                kv.release(slots)

    def _compare(self, rid: int, gen: list[int], logits: torch.Tensor) -> dict[str, Any]:
        ref = self.reference.get(rid)
        if ref is None:
            return {"tokens_equal": None, "logits_equal": None, "max_abs_diff": None}
        ref_gen, ref_logits = ref
        diff = float((logits - ref_logits).abs().max())
        top2 = ref_logits.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()  # the reference's lead of its choice
        return {"tokens_equal": gen == ref_gen,
                "logits_equal": bool(torch.equal(logits, ref_logits)),
                "max_abs_diff": diff,
                "max_abs_ref": float(ref_logits.abs().max()),
                # steps where we chose otherwise, with the reference's margin there
                "flips": [(i, margins[i]) for i, (a, b) in enumerate(zip(gen, ref_gen)) if a != b]}


def deterministic_cuda() -> None:
    """Make the model's CUDA math reproducible run to run: cuBLAS with a fixed workspace
    (needed once work may run on more than one stream or handle), deterministic kernels where
    torch has them, and BF16/FP16 matmuls without reduced-precision reductions. Called
    before the first cuBLAS call of the process."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def replica_main(conn: Connection, spec: dict[str, Any]) -> None:
    """Process entry point (multiprocessing, spawn context)."""
    try:
        import anyio

        from .. import Endpoint, EndpointConfig
        from ..transports import NixlTransport

        torch.set_num_threads(int(spec["threads"]))  # the same on both replicas: same CPU math
        device = torch.device(spec["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
            deterministic_cuda()
        shape = ModelShape(**spec["shape"])
        runner = Runner(shape, int(spec["seed"]), device, int(spec["num_slots"]))
    except BaseException as exc:
        send_error(conn, exc)
        return

    async def main() -> None:
        config = EndpointConfig(trimmed=bool(spec["trimmed"]))
        async with Endpoint(int(spec["rank"]), runner.kv.caches, NixlTransport(), config) as ep:
            replica = Replica(runner, ep, conn, int(spec["chunk_tokens"]))
            replica.warm_up()
            conn.send(("ok", ep.address))

            async def metrics(_: Any) -> dict[str, Any]:
                return ep.snapshot_metrics()

            await serve_commands(conn, {"connect": ep.connect, "batch": replica.run_batch,
                                        "metrics": metrics})

    try:
        anyio.run(main)
    except BaseException as exc:
        send_error(conn, exc)
