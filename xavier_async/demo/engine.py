"""The engine loop of one demo replica: continuous batching with a token budget per step.

Requests join with :meth:`Engine.generate` once their KV prefix is in their slots (loaded
from a peer, or nothing yet). Each step takes every decoding request's next token and then
prefill chunks of the others, first come first served, until ``step_tokens`` rows; the
model runs the step on its own thread (:class:`~xavier_async.demo.model.PagedModel`), so
the event loop stays free for transfers meanwhile: a request whose prefix is still being
loaded (``await endpoint.load_blocks(...)`` in its own task) never holds the others up, and joins
the next step after its load returns. This is the shape of a serving engine's scheduler
(vLLM's chunked prefill), reduced to what the demo needs.

On a source, the loop publishes after each step the prompt blocks that step completed,
of every request, with one call (``Endpoint.publish_blocks``: one copy pass into the
snapshot store), and only then lets that step's finished requests go: a finished request
frees its slots, and the next one may overwrite them at once, since the store keeps the
published bytes.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .model import BLOCK, StepItem, StepResult


@dataclass(eq=False)
class Request:
    """One request in the engine: its prompt, its slots, how many positions already have
    their KV in those slots (``computed``: a loaded prefix counts), and what it produced.

    ``forced``: teacher forcing (decode step ``i + 1`` is fed ``forced[i]`` instead of the
    request's own choice). ``publish``: the keys of the prompt's leading full blocks, to
    publish as the steps complete them (a cold request on a source); ``published``: how
    many of them are. ``snapshot_blocks``:
    the leading blocks copied aside when the request finishes, for checks after the run.
    ``arrival``: when the request arrived (its place in the queue)."""

    rid: str
    tokens: Sequence[int]
    slots: Sequence[int]
    new_tokens: int
    computed: int = 0
    forced: Sequence[int] | None = None
    publish: Sequence[str] = ()
    published: int = 0
    snapshot_blocks: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    snapshot: torch.Tensor | None = None
    steps: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    error: BaseException | None = None
    done: Any = None  # anyio.Event, made on the loop by Engine.generate

    def __post_init__(self) -> None:
        if self.new_tokens < 1:
            raise ValueError("a request decodes at least one token")
        if not 0 <= self.computed < len(self.tokens):
            raise ValueError("at least the prompt's last token is prefilled (its logits give "
                             f"the first output token): computed {self.computed} of {len(self.tokens)}")
        if len(self.slots) * BLOCK < len(self.tokens) + self.new_tokens - 1:
            raise ValueError(f"{len(self.slots)} slots cannot hold {len(self.tokens)} + "
                             f"{self.new_tokens - 1} positions")

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.tokens)

    @property
    def finished(self) -> bool:
        return len(self.out) >= self.new_tokens


def schedule(running: Sequence[Request], step_tokens: int) -> list[tuple[Request, StepItem]]:
    """One step's work: every decoding request's next token, then prefill chunks in the
    order of ``running`` (arrival) until ``step_tokens`` rows (a chunk may be cut
    anywhere: the model's results do not depend on where)."""
    plan: list[tuple[Request, StepItem]] = []
    budget = step_tokens
    for r in running:
        if r.prefilling or r.finished:
            continue
        i = len(r.out) - 1
        fed = r.out[-1] if r.forced is None else r.forced[i]
        last = len(r.out) + 1 >= r.new_tokens
        plan.append((r, StepItem(r.slots, r.computed, [fed], True,
                                 r.snapshot_blocks if last else 0)))
        budget -= 1
    for r in running:
        if budget <= 0:
            break
        if not r.prefilling:
            continue
        n = min(len(r.tokens) - r.computed, budget)
        end = r.computed + n
        sample = end == len(r.tokens)
        last = sample and r.new_tokens == 1
        plan.append((r, StepItem(r.slots, r.computed, r.tokens[r.computed:end], sample,
                                 r.snapshot_blocks if last else 0)))
        budget -= n
    return plan


#: ``publish(keys, slots)``: make blocks loadable by peers (the replica's
#: ``Endpoint.publish_blocks``); the engine may overwrite the slots once it returns
Publish = Callable[[list[str], list[int]], Awaitable[None]]


class Engine:
    """The step loop of one replica. ``run_step`` runs a step on the model thread (the
    replica passes a function that hands it to that thread and awaits the result).

    ``publish``: called once after each step that completed prompt blocks of requests
    with keys to publish, with every such block of the step (one call per step, as the
    seed stages a batch after the forward pass). It is awaited before any request of
    that step finishes, so a request's slots are never freed (and reused) before its
    blocks are copied out."""

    def __init__(self, run_step: Callable[[list[StepItem]], Awaitable[StepResult]],
                 step_tokens: int, publish: Publish | None = None) -> None:
        if step_tokens < 1:
            raise ValueError("step_tokens must be positive")
        self.run_step = run_step
        self.step_tokens = step_tokens
        self.publish = publish
        self._running: list[Request] = []
        self._wake: Any = None
        #: steps run, and rows (tokens) they carried
        self.steps = 0
        self.rows = 0

    async def generate(self, req: Request) -> None:
        """Join the next step; return when ``req`` has all its tokens. Requests are served
        in arrival order (``req.arrival``), not joining order: one that joins late because
        its prefix was loading keeps its place. Not cancellable once joined (a step in
        flight writes into the request's slots, so the caller may free them only after
        it); raises :class:`RuntimeError` if a step failed."""
        import bisect

        import anyio
        req.done = anyio.Event()
        at = bisect.bisect_right([r.arrival for r in self._running], req.arrival)
        self._running.insert(at, req)
        if self._wake is not None:
            self._wake.set()
        with anyio.CancelScope(shield=True):
            await req.done.wait()
        if req.error is not None:
            raise RuntimeError(f"engine step failed: {req.error!r}") from req.error

    async def serve(self) -> None:
        """The loop: run steps while there is work, sleep when there is none. Runs until
        cancelled (for the life of the replica)."""
        import anyio
        while True:
            if not self._running:
                self._wake = anyio.Event()
                await self._wake.wait()
                self._wake = None
                continue
            plan = schedule(self._running, self.step_tokens)
            try:
                result = await self.run_step([item for _, item in plan])
                now = time.perf_counter()
                self.steps += 1
                self.rows += sum(len(item.ids) for _, item in plan)
                finished = self._apply(plan, result, now)
                keys, slots = completed_blocks(r for r, _ in plan)
                if keys and self.publish is not None:
                    await self.publish(keys, slots)
            except Exception as exc:  # fail the requests, keep serving
                for r in self._running:
                    r.error = exc
                    r.done.set()
                self._running.clear()
                continue
            for r in finished:
                self._running.remove(r)
                r.done.set()

    def _apply(self, plan: list[tuple[Request, StepItem]], result: StepResult,
               now: float) -> list[Request]:
        """The step's results into its requests; returns those that finished (they are
        told after the step's blocks are published)."""
        k = 0
        finished = []
        for i, (r, item) in enumerate(plan):
            r.steps += 1
            r.computed += len(item.ids)
            if item.sample:
                r.out.append(result.tokens[k])
                r.logits.append(result.logits[k].clone())  # not the whole step's rows
                k += 1
                if r.first_token_at is None:
                    r.first_token_at = now
            if i in result.snapshots:
                r.snapshot = result.snapshots[i]
            if r.finished:
                r.finished_at = now
                finished.append(r)
        return finished


def completed_blocks(requests: Iterable[Request]) -> tuple[list[str], list[int]]:
    """The keys and slots of the blocks to publish that the requests' computed positions
    now cover in full, marked published."""
    keys: list[str] = []
    slots: list[int] = []
    for r in requests:
        full = min(r.computed // BLOCK, len(r.publish))
        if full > r.published:
            keys += r.publish[r.published:full]
            slots += r.slots[r.published:full]
            r.published = full
    return keys, slots
