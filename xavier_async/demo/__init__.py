"""``xavier-async demo``: prefix sharing between replicas of a real model, each a batched
serving engine.

Three replica processes run transformers' Qwen2 causal LM built from a config with the
same random weights, each under an engine loop (:mod:`.engine`: continuous batching with
a token budget per step) and a paged-attention driver (:mod:`.model`) whose cache slots
are an :class:`~xavier_async.Endpoint`'s caches. Sources A and C prefill cold prompts and
publish their blocks into the snapshot store after each step (``publish_blocks``; C with
``EndpointConfig(trimmed=True)``), then reuse the slots: their paged caches are smaller
than the shared prefix set, and the store's device and host tiers serve; replica B serves the warm
requests that share those prefixes three times (recomputing, loading from A, loading from
C), checks every answer against recomputing, and the driver prints the TTFT table and a
break-even sweep of prefix length. The engine never imports this package; it needs the
``demo`` extra (``transformers``).

``python -m xavier_async.demo --help`` lists the options; :func:`add_arguments` and
:func:`run` plug the same command into another argument parser.
"""

from __future__ import annotations

from .driver import add_arguments, run, run_demo

__all__ = ["add_arguments", "run", "run_demo"]
