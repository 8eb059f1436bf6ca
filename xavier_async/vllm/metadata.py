"""What the scheduler tells the workers each step (pure, picklable dataclasses).

vLLM pickles the step's connector metadata from the scheduler process to every worker;
:class:`StepPlan` is all of it: the loads to run (each one request's prefix blocks from
one peer), the blocks to publish once the step's forward has computed them, and the
requests whose block frees wait for a load still in flight."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load ``keys[i]`` from ``peer`` into block ``slots[i]`` of every layer."""

    req_id: str
    peer: int
    keys: tuple[int, ...]
    slots: tuple[int, ...]
    #: inside this step, before the forward (else between steps: ``get_finished``)
    sync: bool


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One engine step's work for the connector's workers."""

    loads: tuple[LoadSpec, ...] = ()
    #: blocks this step completes: ``publish_keys[i]`` is computed into ``publish_slots[i]``
    publish_keys: tuple[int, ...] = ()
    publish_slots: tuple[int, ...] = ()
    #: finished requests whose blocks vLLM frees only once their async load has ended
    delayed_frees: tuple[str, ...] = field(default=())

    @property
    def empty(self) -> bool:
        return not (self.loads or self.publish_keys or self.delayed_frees)


__all__ = ["LoadSpec", "StepPlan"]
