"""``xavier-async demo``: prefix sharing between two replicas of a real model.

Two replica processes each run transformers' Qwen2 causal LM built from a config with the
same random weights, on a paged KV cache whose slots are an :class:`~xavier_async.Endpoint`'s
caches. Replica A prefills cold prompts and publishes their blocks; replica B serves warm
requests sharing those prefixes by loading the blocks over NIXL, and checks every answer
against recomputing the prefix itself. The engine never imports this package; it needs
the ``demo`` extra (``transformers``).

``python -m xavier_async.demo --help`` lists the options; :func:`add_arguments` and
:func:`run` plug the same command into another argument parser.
"""

from __future__ import annotations

from .driver import add_arguments, run, run_demo

__all__ = ["add_arguments", "run", "run_demo"]
