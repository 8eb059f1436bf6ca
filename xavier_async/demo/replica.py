"""One serving replica of the demo, in its own process: a
:class:`~xavier_async.demo.model.PagedModel` (model + paged KV cache), an
:class:`~xavier_async.demo.engine.Engine` that runs batched steps on one model thread, and
one :class:`~xavier_async.Endpoint` over NIXL whose caches are the model's slot tensors.

The driver sends it batches of requests over a pipe. Each request is an async task (at
most ``concurrency`` at once) that takes its slots, fills what it can of its prefix and
then joins the engine, which batches it with every other request in flight. The model
thread is one dedicated thread (one device, and on CUDA one cuBLAS handle and one
stream), so while a step runs the event loop keeps driving transfers. Three modes:

* ``cold``: prefill the whole prompt, decode; the engine **publishes** its full blocks
  after the steps that complete them (:meth:`Replica._publish`: ``publish_blocks``, one
  call per step). With the snapshot store (on unless both tier budgets are 0) the blocks
  are copied out, and the request frees its slots when it finishes: they stay in the
  paged cache, as a prefix cache keeps them, until another request needs the slots
  (least recently freed first), while the store keeps serving the blocks. Without the
  store the request keeps its slots (they are what peers load from).
* ``load``: the driver found ``hits`` (a prefix of block hashes) on peer ``source``:
  **load** them into the request's first slots, then join the engine with that prefix
  computed; on any :class:`~xavier_async.XavierError` join with nothing computed instead
  (recompute).
* ``recompute``: join with nothing computed. This is the reference every ``load``
  request is compared against.

Nothing that checks an answer runs before the batch's last token: digests of the KV
blocks (copied aside when a request finishes) and comparisons with the reference run
after the timed part, and the reply carries both.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from ..testing.child import send_error, serve_commands
from .engine import Engine, Request
from .model import (
    BLOCK,
    ModelShape,
    PagedModel,
    StepItem,
    StepResult,
    block_digests,
    blocks_for,
)

T = TypeVar("T")


class Replica:
    """The request handling of one replica (runs on the replica's event loop).
    ``store``: the endpoint copies published blocks into its snapshot store (a cold
    request may then free its slots)."""

    def __init__(self, model: PagedModel, endpoint: Any, conn: Connection | None, step_tokens: int,
                 store: bool = True) -> None:
        self.model = model
        self.ep = endpoint
        self.conn = conn
        self.store = store
        #: float32 on the CPU is compared bit for bit (free-running); BF16 with tolerance
        self.exact = model.invariant
        self._model_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        self.engine = Engine(self._step, step_tokens, publish=self._publish)
        #: what each publish_blocks call did, in order (the driver's directory follows it)
        self.publish_log: list[dict[str, Any]] = []
        #: publish_blocks calls and the seconds they took
        self.publish_calls = 0
        self.publish_s = 0.0
        self._freed: Any = None  # anyio.Event: slots were freed
        #: request id -> (tokens, logits, prefix block digests) of the recompute path
        self.reference: dict[str, tuple[list[int], torch.Tensor, list[str]]] = {}

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        # worker threads start on the default CUDA device: make ours current there
        if self.model.device.type == "cuda":
            with torch.cuda.device(self.model.device):
                yield
        else:
            yield

    def _submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        def call() -> T:
            with self._on_device():
                return fn(*args)
        return self._model_thread.submit(call)

    async def _model(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a call on the model thread; a cancelled caller still waits for it."""
        import anyio
        return await anyio.to_thread.run_sync(self._submit(fn, *args).result)

    async def _step(self, items: list[StepItem]) -> StepResult:
        return await self._model(self.model.step, items)

    async def _publish(self, keys: list[str], slots: list[int]) -> None:
        """The engine's publish hook: one ``publish_blocks`` per step. When it returns the
        blocks are in the store (or reported skipped, failed), and the slots are the
        engine's again; the log tells the driver which keys became loadable and which
        ones the store evicted to make room."""
        t0 = time.perf_counter()
        res = await self.ep.publish_blocks(keys, slots)
        self.publish_s += time.perf_counter() - t0
        self.publish_calls += 1
        slot_of = dict(zip(keys, slots))
        self.publish_log.append({"available": [(k, slot_of[k]) for k in res.available],
                                 "evicted": list(res.evicted), "skipped": list(res.skipped),
                                 "failed": list(res.failed), "demoted": len(res.demoted)})

    async def _alloc(self, n: int, keeps: bool) -> list[int]:
        """``n`` slots, waiting for requests in flight to free some (as a scheduler admits a
        request once its blocks fit). ``keeps``: the caller will not free them."""
        import anyio
        kv = self.model.kv
        if n > kv.num_slots:
            raise RuntimeError(f"a request needs {n} KV slots, the cache has {kv.num_slots}")
        while kv.free_slots < n:
            if keeps:  # nothing in flight frees slots: waiting would never end
                raise RuntimeError(
                    f"out of KV slots: need {n}, {kv.free_slots} free; without the snapshot "
                    "store a source keeps every slot it published")
            if self._freed is None:
                self._freed = anyio.Event()
            await self._freed.wait()
        return kv.alloc(n)

    def _release(self, slots: list[int], cached: list[str]) -> None:
        self.model.kv.release(slots, cached)
        if self._freed is not None:
            self._freed.set()
            self._freed = None

    async def warm_up(self) -> None:
        """One request through the engine, as long as a full step (or as the free slots
        allow), prefill and decode, so the first timed request pays no start-up cost
        (kernel selection for the largest shapes, on the GPU)."""
        kv, vocab = self.model.kv, self.model.shape.vocab
        n = max(min(self.engine.step_tokens, (kv.free_slots - 1) * BLOCK - 2), 2 * BLOCK)
        tokens = [t % vocab for t in range(n + 1)]
        slots = kv.alloc(blocks_for(len(tokens), 2))
        try:
            await self.engine.generate(Request("warm-up", tokens, slots, 2))
        finally:
            self._release(slots, [])

    # -- one batch of requests ------------------------------------------------------------
    async def run_batch(self, arg: dict[str, Any]) -> dict[str, Any]:
        import anyio
        mode: str = arg["mode"]
        cancel = set(arg.get("cancel", ()))
        gate = anyio.Semaphore(int(arg.get("concurrency", 16)))
        first_load = anyio.Event()
        done: dict[int, tuple[dict[str, Any], Request | None]] = {}

        async def one(i: int, req: dict[str, Any]) -> None:
            async with gate:
                done[i] = await self._request(req, mode, int(arg["new_tokens"]),
                                              str(req["id"]) in cancel, first_load, tg)

        async def signal_loading() -> None:
            # failure injection: tell the driver that a load is in flight (it then kills the source)
            await first_load.wait()
            await anyio.sleep(0.2)
            if self.conn is not None:
                self.conn.send(("event", "loading"))

        steps, rows = self.engine.steps, self.engine.rows
        kv, calls, publish_s = self.model.kv, self.publish_calls, self.publish_s
        evicted = kv.evicted
        self.publish_log = []
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            if arg.get("signal_loading"):
                tg.start_soon(signal_loading)
            async with anyio.create_task_group() as reqs:
                for i, req in enumerate(arg["requests"]):
                    reqs.start_soon(one, i, req)
            tg.cancel_scope.cancel()
        wall = time.perf_counter() - t0
        # the timed part ends here: the checks below cost nothing a request waited for
        results = [self._check(out, r) for out, r in (done[i] for i in sorted(done))]
        return {"wall_s": wall, "steps": self.engine.steps - steps, "rows": self.engine.rows - rows,
                "requests": results, "publish_log": self.publish_log,
                "publish_calls": self.publish_calls - calls, "publish_s": self.publish_s - publish_s,
                "cache": {"slots": kv.num_slots, "cached": len(kv.cached),
                          "evicted": kv.evicted - evicted}}

    @staticmethod
    async def _cancel_soon(scope: Any) -> None:
        import anyio
        await anyio.lowlevel.checkpoint()
        scope.cancel()

    async def _request(self, req: dict[str, Any], mode: str, new_tokens: int, cancel: bool,
                       first_load: Any, side: Any) -> tuple[dict[str, Any], Request | None]:
        import anyio

        from .. import XavierError
        rid = str(req["id"])
        tokens: list[int] = req["tokens"]
        hashes: list[str] = req["hashes"] if mode == "cold" else req.get("hits", [])
        out: dict[str, Any] = {"id": rid, "mode": mode, "kind": req.get("kind", "warm"),
                               "hits": 0 if mode == "cold" else len(hashes),
                               "hit_hashes": [] if mode == "cold" else list(hashes), "loaded": False,
                               "fallback": None, "cancelled": False}
        t0 = time.perf_counter()
        # a cold request's slots stay published (and so taken) only without the store
        keep = mode == "cold" and not self.store
        slots = await self._alloc(blocks_for(len(tokens), new_tokens), keep)
        cached: list[str] = []  # keys of the blocks the slots hold when freed
        computed = 0
        try:
            if mode == "load" and hashes:
                try:
                    with anyio.CancelScope() as scope:
                        if cancel:  # cancelled mid-load: the load is under way when this fires
                            side.start_soon(self._cancel_soon, scope)
                        first_load.set()
                        # the prefix blocks, every layer: hashes[i] into slots[i]
                        loaded = await self.ep.load_blocks(req["source"], hashes,
                                                           slots[:len(hashes)])
                    if scope.cancelled_caught:
                        out["cancelled"] = True
                        out["latency_s"] = time.perf_counter() - t0
                        return out, None
                    out["loaded"] = True
                    # where the source served the blocks from ((layer, block) pairs per tier)
                    out["load"] = {"batches": loaded.batches, "device_blocks": loaded.device_tier_blocks,
                                   "host_blocks": loaded.host_tier_blocks}
                    computed = len(hashes) * BLOCK
                except XavierError as exc:  # the slots hold garbage: recompute them
                    # (a source lost, or a block evicted from its store after routing)
                    out["fallback"] = type(exc).__name__
            out["joined_s"] = time.perf_counter() - t0
            forced = None
            if mode == "load" and not self.exact:
                # BF16: decode on the reference's tokens (teacher forcing), so that one step's
                # near-tie cannot turn every later step into a different continuation
                forced = self.reference.get(rid, (None,))[0]
            if mode == "cold":
                out["hashes"] = list(hashes)
            r = Request(rid, tokens, slots, new_tokens, computed=computed, forced=forced,
                        publish=hashes if mode == "cold" else (),
                        snapshot_blocks=len(hashes), arrival=t0)
            await self.engine.generate(r)
            assert r.first_token_at is not None and r.finished_at is not None
            out["ttft_s"] = r.first_token_at - t0
            out["latency_s"] = r.finished_at - t0
            if mode == "cold":
                cached = list(hashes)
            return out, r
        finally:
            if not keep:
                self._release(slots, cached)

    # -- after the timed part --------------------------------------------------------------
    def _check(self, out: dict[str, Any], r: Request | None) -> dict[str, Any]:
        """Digests of the request's prefix blocks and the comparison with the reference."""
        if r is None:
            return out
        digests = block_digests(r.snapshot) if r.snapshot is not None else []
        logits = torch.stack(r.logits)
        out.update(tokens=list(r.out), steps=r.steps, digests=digests)
        if out["mode"] == "recompute":
            self.reference[r.rid] = (list(r.out), logits, digests)
        elif out["mode"] == "load":
            out.update(self._compare(r.rid, r.out, logits))
            ref = self.reference.get(r.rid)
            out["kv_equal"] = (digests == ref[2]) if out["loaded"] and ref is not None else None
        return out

    def _compare(self, rid: str, gen: Sequence[int], logits: torch.Tensor) -> dict[str, Any]:
        ref = self.reference.get(rid)
        if ref is None:
            return {"tokens_equal": None, "logits_equal": None, "max_abs_diff": None}
        ref_gen, ref_logits, _ = ref
        a, b = logits.float(), ref_logits.float()
        diff = float((a - b).abs().max())
        top2 = b.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()  # the reference's lead of its choice
        return {"tokens_equal": list(gen) == ref_gen,
                "logits_equal": bool(torch.equal(logits, ref_logits)),
                "max_abs_diff": diff,
                "max_abs_ref": float(b.abs().max()),
                # steps where we chose otherwise, with the reference's margin there
                "flips": [(i, margins[i]) for i, (x, y) in enumerate(zip(gen, ref_gen)) if x != y]}


#: the GIL switch interval of a replica process (Python's default: 5 ms)
SWITCH_INTERVAL_S = 0.0005


def deterministic_cuda() -> None:
    """Make the model's CUDA math reproducible where it can be: cuBLAS with a fixed
    workspace, and BF16/FP16 matmuls without reduced-precision reductions. Called before
    the first cuBLAS call of the process. (Batched steps still change shapes run to run,
    so BF16 answers are compared with a tolerance.)"""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # cuDNN's attention builds an execution plan per new shape, and a batched engine's
    # steps are new shapes all the time (chunk lengths, block counts): the memory-
    # efficient kernel takes any shape and mask without a plan
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def replica_main(conn: Connection, spec: dict[str, Any]) -> None:
    """Process entry point (multiprocessing, spawn context)."""
    try:
        import anyio

        from .. import Endpoint, EndpointConfig, NixlTransport

        torch.set_num_threads(int(spec["threads"]))  # the same on all replicas: same CPU math
        # The model thread runs a step as hundreds of short torch calls, each taking the
        # GIL back: at Python's default 5 ms switch interval the event loop (the loads'
        # requests, completions and the NIXL poller) waited milliseconds per wake-up
        # (the first H200 run: a 12 MiB load's receiver wait 5.5 ms at p50 while the
        # source's work took 1.8 ms). An engine that steps on a thread beside the event
        # loop should do the same (docs/integration.md).
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        device = torch.device(spec["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
            deterministic_cuda()
        shape = ModelShape(**spec["shape"])
        model = PagedModel(shape, int(spec["seed"]), device, int(spec["num_slots"]))
    except BaseException as exc:
        send_error(conn, exc)
        return

    async def main() -> None:
        # the snapshot store's tiers (the sources'; the replica under test publishes
        # nothing and asks for none)
        config = EndpointConfig(trimmed=bool(spec["trimmed"]),
                                snapshot_gpu_bytes=int(spec["device_tier_bytes"]),
                                snapshot_cpu_bytes=spec["host_tier_bytes"])
        async with Endpoint(int(spec["rank"]), model.kv.caches, NixlTransport(), config) as ep:
            # on CUDA without Triton the endpoint turns the store off: then the slots are kept
            store = "snapshot" in ep.snapshot_metrics()
            replica = Replica(model, ep, conn, int(spec["step_tokens"]), store)

            async def metrics(_: Any) -> dict[str, Any]:
                return ep.snapshot_metrics()

            async with anyio.create_task_group() as tg:
                tg.start_soon(replica.engine.serve)
                await replica.warm_up()
                conn.send(("ok", {"address": ep.address, "store": store}))
                await serve_commands(conn, {"connect": ep.connect, "batch": replica.run_batch,
                                            "metrics": metrics})
                tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    except BaseException as exc:
        send_error(conn, exc)
