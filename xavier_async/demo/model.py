"""The model side of the demo: a Qwen2 causal LM with random weights and a paged KV cache
whose slots are the tensors an :class:`~xavier_async.Endpoint` serves and loads.

A cache is, per model layer, one tensor ``[num_slots, 2, kv_heads, 16, head_dim]``: slot
``s`` holds K (``[s, 0]``) and V (``[s, 1]``) of one 16-token block. Prefill writes full
blocks into slots; :meth:`Runner.finish` rebuilds a transformers ``DynamicCache`` from
slots, prefills the rest of the prompt and decodes greedily. Everything here is plain
torch + transformers, run from a worker thread; nothing in it knows about transfers.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: tokens per KV block (the seed's geometry)
BLOCK = 16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    """The Qwen2 dimensions the demo builds (random weights, no download)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    dtype: str

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one 16-token block across all layers (K and V)."""
        el = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.layers * 2 * self.kv_heads * BLOCK * self.head_dim * el

    def config(self) -> Any:
        from transformers import Qwen2Config
        return Qwen2Config(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, max_position_embeddings=32768,
            tie_word_embeddings=True, use_sliding_window=False,
            # wider than the default 0.02: random weights then produce varied tokens
            # (at 0.02 greedy decoding repeats one token, a weak check)
            initializer_range=0.1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "head_dim": self.head_dim, "block_nbytes": self.block_nbytes}


#: the CPU default: runs in seconds, float32 so the two paths can be compared bit for bit
SMALL = ModelShape(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1024,
                   dtype="float32")
#: the Qwen2.5-0.5B shape in BF16 (one block: 24 x 2 x 2 x 16 x 64 x 2 B = 196,608 B)
QWEN25_05B = ModelShape(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864,
                        vocab=151936, dtype="bfloat16")


def block_hashes(tokens: Sequence[int], n_blocks: int, salt: bytes) -> list[str]:
    """Chained block hashes, as serving engines compute them for prefix caching: block
    ``i``'s hash covers the previous block's hash and block ``i``'s token ids, so equal
    hashes mean equal prefixes. ``salt`` names the model (different models never match)."""
    if n_blocks * BLOCK > len(tokens):
        raise ValueError(f"{n_blocks} blocks need {n_blocks * BLOCK} tokens, got {len(tokens)}")
    prev = hashlib.blake2b(salt, digest_size=16).digest()
    out = []
    for i in range(n_blocks):
        ids = tokens[i * BLOCK:(i + 1) * BLOCK]
        h = hashlib.blake2b(prev + b"".join(int(t).to_bytes(4, "little") for t in ids),
                            digest_size=16)
        prev = h.digest()
        out.append(h.hexdigest())
    return out


def cacheable_blocks(n_tokens: int) -> int:
    """Full blocks of a prompt that may come from a cache: at least one token is always
    prefilled, since its logits give the first output token."""
    return max(n_tokens - 1, 0) // BLOCK


class PagedKV:
    """The per-layer slot tensors and a free list of slots."""

    def __init__(self, shape: ModelShape, num_slots: int, device: torch.device) -> None:
        self.shape = shape
        self.caches: dict[int, torch.Tensor] = {
            layer: torch.zeros(num_slots, 2, shape.kv_heads, BLOCK, shape.head_dim,
                               dtype=shape.torch_dtype, device=device)
            for layer in range(shape.layers)}
        self._free = list(reversed(range(num_slots)))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free slots (last freed first, so a slot is reused soon after release)."""
        if n > len(self._free):
            raise RuntimeError(f"out of KV slots: need {n}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, slots: Sequence[int]) -> None:
        self._free.extend(reversed(slots))

    def digest(self, slot: int) -> str:
        """sha256 of one block's bytes across all layers."""
        h = hashlib.sha256()
        for cache in self.caches.values():
            h.update(cache[slot].contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest()


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[1, kv_heads, seq, head_dim]`` of one layer of a ``DynamicCache``
    (transformers >= 4.56 keeps them in ``layers``; older versions in ``key_cache``)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


class Runner:
    """The model and the paged cache of one replica. Call its methods from one thread at
    a time (the replica runs them in a worker thread behind a capacity limiter of 1)."""

    def __init__(self, shape: ModelShape, seed: int, device: torch.device, num_slots: int) -> None:
        from transformers import Qwen2ForCausalLM
        self.shape = shape
        self.device = device
        torch.manual_seed(seed)  # identical weights on every replica
        config = shape.config()
        config._attn_implementation = "sdpa"
        model: Any = Qwen2ForCausalLM(config)
        self.model: Any = model.to(dtype=shape.torch_dtype, device=device).eval()
        self.kv = PagedKV(shape, num_slots, device)
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values -> cache and num_logits_to_keep -> logits_to_keep
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)

    # -- the cache built from slots -----------------------------------------------------
    def cache_from_slots(self, slots: Sequence[int]) -> Any:
        """A ``DynamicCache`` holding the blocks in ``slots``, in order."""
        from transformers import DynamicCache
        cache = DynamicCache()
        if not slots:
            return cache
        idx = torch.tensor(list(slots), device=self.device)
        n, h, d = len(slots), self.shape.kv_heads, self.shape.head_dim
        for layer, t in self.kv.caches.items():
            blk = t.index_select(0, idx)                       # [n, 2, h, 16, d]
            k = blk[:, 0].permute(1, 0, 2, 3).reshape(1, h, n * BLOCK, d)
            v = blk[:, 1].permute(1, 0, 2, 3).reshape(1, h, n * BLOCK, d)
            cache.update(k, v, layer)
        return cache

    def _store(self, cache: Any, first_block: int, slots: Sequence[int]) -> None:
        """Copy blocks ``first_block ...`` of ``cache`` into ``slots``."""
        n, h, d = len(slots), self.shape.kv_heads, self.shape.head_dim
        idx = torch.tensor(list(slots), device=self.device)
        lo, hi = first_block * BLOCK, (first_block + n) * BLOCK
        for layer, t in self.kv.caches.items():
            k, v = _layer_kv(cache, layer)
            kv = torch.stack([k[0, :, lo:hi], v[0, :, lo:hi]])   # [2, h, n*16, d]
            t.index_copy_(0, idx, kv.view(2, h, n, BLOCK, d).permute(2, 0, 1, 3, 4))

    def _forward(self, ids: Sequence[int], start: int, cache: Any) -> torch.Tensor:
        """Run ``ids`` at positions ``start...`` through the model on ``cache`` (extended in
        place); return the last position's logits as float32 ``[vocab]``."""
        input_ids = torch.tensor([list(ids)], device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        kw: dict[str, Any] = {self._cache_kw: cache}
        if self._keep_kw is not None:
            kw[self._keep_kw] = 1
        out = self.model(input_ids=input_ids, position_ids=pos, use_cache=True, **kw)
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

    # -- prefill and decode ---------------------------------------------------------------
    @torch.no_grad()
    def prefill_blocks(self, tokens: Sequence[int], slots: Sequence[int], chunk_tokens: int) -> None:
        """Prefill the ``len(slots)`` full blocks at the start of ``tokens`` into ``slots``,
        in chunks of ``chunk_tokens`` counted from token 0 (so two replicas that prefill
        the same prefix run the same shapes, and in float32 on the CPU write the same
        bytes). Each chunk runs on a cache rebuilt from the slots before it."""
        n = len(slots)
        per = max(chunk_tokens // BLOCK, 1)
        for b0 in range(0, n, per):
            b1 = min(b0 + per, n)
            cache = self.cache_from_slots(slots[:b0])
            self._forward(tokens[b0 * BLOCK:b1 * BLOCK], b0 * BLOCK, cache)
            self._store(cache, b0, slots[b0:b1])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def first_token(self, tokens: Sequence[int], prefix_slots: Sequence[int]) -> tuple[Any, torch.Tensor]:
        """Prefill what follows the cached prefix (``prefix_slots``) on a cache built from
        those slots. Returns the cache and the first output position's logits."""
        cache = self.cache_from_slots(prefix_slots)
        start = len(prefix_slots) * BLOCK
        logits = self._forward(tokens[start:], start, cache)
        logits.cpu()  # the first token exists once this returns
        return cache, logits

    @torch.no_grad()
    def decode(self, cache: Any, first: torch.Tensor, position: int, new_tokens: int,
               forced: Sequence[int] | None = None) -> tuple[list[int], torch.Tensor]:
        """Greedy decoding from the first logits. Returns the tokens and every step's
        logits ``[new_tokens, vocab]`` (float32, on the CPU). With ``forced`` (teacher
        forcing) step ``i + 1`` is fed ``forced[i]`` instead of our own choice, so logits
        can be compared step by step with a reference even where a near-tie flipped."""
        logits = [first]
        out = [int(first.argmax())]
        for i in range(new_tokens - 1):
            fed = out[-1] if forced is None else forced[i]
            logits.append(self._forward([fed], position + i, cache))
            out.append(int(logits[-1].argmax()))
        return out, torch.stack(logits).cpu()
