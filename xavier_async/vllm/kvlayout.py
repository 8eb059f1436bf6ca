"""vLLM's KV cache tensors -> the endpoint's caches ``{layer id: [num_blocks, *block]}``.

The layout is read from what vLLM hands ``register_kv_caches``, never assumed:

* the CPU backend: per layer ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
  block dim 0, each block contiguous: one cache per layer;
* the GPU backends: per layer ``[2, num_blocks, block_size, num_kv_heads, head_size]``:
  K and V are two caches, each ``[num_blocks, ...]`` and contiguous.

Layer ids are integers in the order of the layers' indices in their names (equal on
every replica of one model), so block loads travel as the binary request."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..errors import LayoutMismatchError

_INDEX = re.compile(r"(\d+)")


def _order(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in _INDEX.findall(name))


def endpoint_caches(kv_caches: Mapping[str, torch.Tensor], num_blocks: int
                    ) -> tuple[dict[int, torch.Tensor], str]:
    """The endpoint's caches over vLLM's tensors (views, no copy) and the layout's name
    (``"blocks-first"`` or ``"kv-first"``). :class:`LayoutMismatchError` for a layout
    this connector does not know."""
    if not kv_caches:
        raise LayoutMismatchError("vLLM registered no KV cache tensors")
    caches: dict[int, torch.Tensor] = {}
    kind = ""
    for i, name in enumerate(sorted(kv_caches, key=lambda n: (_order(n), n))):
        t = kv_caches[name]
        if t.dim() >= 2 and t.shape[0] == num_blocks and t.is_contiguous():
            caches[i] = t
            layer_kind = "blocks-first"
        elif t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks \
                and t[0].is_contiguous() and t[1].is_contiguous():
            caches[2 * i], caches[2 * i + 1] = t[0], t[1]
            layer_kind = "kv-first"
        else:
            raise LayoutMismatchError(
                f"KV cache {name!r} has shape {tuple(t.shape)} (strides {t.stride()}); "
                f"expected [num_blocks={num_blocks}, ...] or [2, num_blocks={num_blocks}, ...], "
                "each block contiguous")
        if kind and layer_kind != kind:
            raise LayoutMismatchError(f"KV cache {name!r} is {layer_kind}, the others {kind}")
        kind = layer_kind
    return caches, kind


__all__ = ["endpoint_caches"]
