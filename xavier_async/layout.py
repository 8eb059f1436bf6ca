"""Cache layouts and the checks run on caller input before any byte moves (pure core)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Union

import torch

from ._checks import check_int
from .errors import InvalidRequestError, LayoutMismatchError

LayerId = Union[int, str]
BlockKey = Union[int, str, bytes]

#: Packed segments start at multiples of this, so any dtype can be viewed in place.
SEGMENT_ALIGN = 16


class _AllLayers:
    """The type of :data:`ALL_LAYERS` (one instance)."""

    _instance: _AllLayers | None = None

    def __new__(cls) -> _AllLayers:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ALL_LAYERS"

    def __reduce__(self) -> str:
        return "ALL_LAYERS"


#: In a load request, stands for every layer of the loading endpoint's caches:
#: ``{src: {ALL_LAYERS: {key: slot}}}`` loads ``key`` into ``slot`` of each layer.
ALL_LAYERS: Final = _AllLayers()


@dataclass(frozen=True)
class LayerSpec:
    """Shape and dtype of one block of one layer (a cache is ``[num_slots, *block_shape]``)."""

    block_shape: tuple[int, ...]
    dtype: torch.dtype
    num_slots: int

    @functools.cached_property
    def block_nbytes(self) -> int:
        """Bytes of one block (computed once)."""
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.block_shape:
            n *= d
        return n

    def wire(self) -> list[Any]:
        """The part two endpoints must agree on (slot counts may differ)."""
        return [list(self.block_shape), str(self.dtype).removeprefix("torch.")]


@dataclass(frozen=True)
class CacheLayout:
    """Per-layer block layout of an endpoint's caches, plus the device they live on."""

    layers: Mapping[LayerId, LayerSpec]
    device: torch.device

    @classmethod
    def of(cls, caches: Mapping[Any, torch.Tensor]) -> CacheLayout:
        """Validate ``{layer: tensor[num_slots, *block_shape]}`` and describe it."""
        if not isinstance(caches, Mapping) or not caches:
            raise InvalidRequestError("caches must be a non-empty mapping {layer: tensor}")
        layers: dict[LayerId, LayerSpec] = {}
        device: torch.device | None = None
        for layer, t in caches.items():
            check_layer_id(layer)
            if not isinstance(t, torch.Tensor):
                raise InvalidRequestError(f"cache for layer {layer!r} is not a torch.Tensor")
            if t.dim() < 2:
                raise InvalidRequestError(
                    f"cache for layer {layer!r} must be [num_slots, *block_shape], got shape "
                    f"{tuple(t.shape)}")
            if not t.is_contiguous():
                raise InvalidRequestError(f"cache for layer {layer!r} is not contiguous")
            if t.shape[0] < 1 or t[0].numel() == 0:
                raise InvalidRequestError(f"cache for layer {layer!r} is empty")
            if device is None:
                device = t.device
            elif t.device != device:
                raise InvalidRequestError(
                    f"all caches must be on one device: layer {layer!r} is on {t.device}, "
                    f"others on {device}")
            layers[layer] = LayerSpec(tuple(t.shape[1:]), t.dtype, int(t.shape[0]))
        if device is None:  # (there is at least one layer: checked above)
            raise InvalidRequestError("caches must hold at least one layer")
        return cls(layers, device)

    def wire(self) -> list[Any]:
        """A JSON-able description used in the handshake."""
        return [[layer, spec.wire()] for layer, spec in self.layers.items()]

    def check_compatible(self, peer_wire: list[Any], peer: str) -> None:
        """Raise :class:`LayoutMismatchError` unless the shared layers agree on shape and dtype."""
        theirs = {layer: spec for layer, spec in peer_wire}  # JSON keeps int and str apart
        problems = []
        for layer, spec in self.layers.items():
            if layer in theirs and theirs[layer] != spec.wire():
                problems.append(f"layer {layer!r}: local {spec.wire()} vs {peer} {theirs[layer]}")
        if problems:
            raise LayoutMismatchError("cache layout mismatch: " + "; ".join(problems))


def check_layer_id(layer: object) -> None:
    if isinstance(layer, bool) or not isinstance(layer, (int, str)):
        raise InvalidRequestError(f"layer ids must be int or str, got {layer!r}")


def check_layers(layers: object) -> list[LayerId]:
    """An iterable of layer ids (not a single id: a ``str`` or ``bytes`` is refused rather
    than read as its characters); returns them as a list."""
    if isinstance(layers, (str, bytes, bytearray)) or not isinstance(layers, Iterable):
        raise InvalidRequestError(f"layers must be an iterable of layer ids such as [0, 1], got "
                                  f"{layers!r} (wrap a single layer id in a list)")
    try:
        out = list(layers)
    except TypeError:  # iterable in name only (a 0-d tensor or array)
        raise InvalidRequestError(f"layers must be an iterable of layer ids such as [0, 1], "
                                  f"got {layers!r}") from None
    for layer in out:
        check_layer_id(layer)
    return out


def check_key(key: object) -> None:
    if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
        raise InvalidRequestError(f"block keys must be int, str or bytes, got {key!r}")


def check_slot(slot: object, spec: LayerSpec, layer: LayerId) -> int:
    """A slot index of ``layer`` (numpy and torch integers accepted); returns a plain int."""
    if type(slot) is not int:
        if isinstance(slot, bool) or not hasattr(slot, "__index__"):
            raise InvalidRequestError(f"slot for layer {layer!r} must be an int, got {slot!r}")
        slot = check_int(f"slot for layer {layer!r}", slot)
    if not 0 <= slot < spec.num_slots:
        raise InvalidRequestError(
            f"slot {slot} out of range for layer {layer!r} ({spec.num_slots} slots)")
    return slot


def align_up(n: int, align: int) -> int:
    return -(-n // align) * align
