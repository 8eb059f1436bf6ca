"""The model side of the demo: transformers' Qwen2 with random weights, run by our own
paged-attention driver over a paged KV cache whose slots are the tensors an
:class:`~xavier_async.Endpoint` serves and loads.

A cache is, per model layer, one tensor ``[num_slots + 1, 2, kv_heads, 16, head_dim]``:
slot ``s`` holds K (``[s, 0]``) and V (``[s, 1]``) of one 16-token block; the last slot
is a scratch block (never allocated) that pads block tables. :meth:`PagedModel.step` runs
one engine step: the prefill chunks and decode tokens of many requests, packed into one
batch of token rows for every linear layer (the model's own modules and weights), with
attention over each request's pages gathered from the cache. Plain torch + transformers,
run from one worker thread; nothing here knows about transfers.

Batch invariance (CPU, float32): a request's logits and KV bytes must not depend on which
other requests share its steps, or how its prompt was cut into chunks, so that loading
and recomputing a prefix can be compared bit for bit. Measured on this CPU (MKL, one
thread): a GEMM's rows come out the same whatever the row count from 16 rows up, so the
invariant mode pads every GEMM to a multiple of 16 rows, and computes attention in fixed
128-key tiles from position 0 with an online softmax (a tile past a query's position adds
exact zeros), so no reduction depends on the batch. The GPU path (BF16) is not invariant:
it uses SDPA over the gathered pages and is compared with a tolerance.
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

#: tokens per KV block (the seed's geometry)
BLOCK = 16
#: rows a GEMM is padded to (a multiple of) in the batch-invariant mode
ROW_ALIGN = 16
#: keys per attention tile in the batch-invariant mode (a multiple of BLOCK)
ATTN_TILE = 128

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


def blocks_for(prompt_tokens: int, new_tokens: int) -> int:
    """Slots a request needs: its prompt and every decoded token but the last (which is
    never fed back)."""
    return -(-(prompt_tokens + new_tokens - 1) // BLOCK)


class PagedKV:
    """The per-layer slot tensors, the free slots in LRU order and one scratch slot.

    As in a serving engine's prefix cache (vLLM's free block queue), a freed slot keeps
    its block until the slot is allocated again: :meth:`release` appends the slots to the
    free queue (a request's last block first, so that its tail, the least shareable part,
    goes first) and may name the block each one holds (``cached``); :meth:`alloc` takes
    the least recently freed slots and counts each one that still held a block as evicted.
    """

    def __init__(self, shape: ModelShape, num_slots: int, device: torch.device) -> None:
        self.shape = shape
        self.num_slots = num_slots
        self.caches: dict[int, torch.Tensor] = {
            layer: torch.zeros(num_slots + 1, 2, shape.kv_heads, BLOCK, shape.head_dim,
                               dtype=shape.torch_dtype, device=device)
            for layer in range(shape.layers)}
        #: pads block tables; never allocated, never written
        self.scratch = num_slots
        self._free: collections.deque[int] = collections.deque(range(num_slots))
        #: free slots that still hold a block: slot -> the block's key
        self.cached: dict[int, str] = {}
        #: blocks evicted from the cache (their slot was allocated again)
        self.evicted = 0

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free slots, least recently freed first (evicting the blocks they held)."""
        if n > len(self._free):
            raise RuntimeError(f"out of KV slots: need {n}, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for s in out:
            if self.cached.pop(s, None) is not None:
                self.evicted += 1
        return out

    def release(self, slots: Sequence[int], cached: Sequence[str] = ()) -> None:
        """Free ``slots``; ``cached[i]``: the key of the block ``slots[i]`` still holds."""
        for s, key in zip(slots, cached):
            self.cached[s] = key
        self._free.extend(reversed(slots))

    def snapshot(self, slots: Sequence[int]) -> torch.Tensor:
        """A copy of the blocks in ``slots``: ``[n, layers, 2, kv_heads, 16, head_dim]``, on
        the caches' device (enqueued, not waited for)."""
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.caches[0].device)
        return torch.stack([c.index_select(0, idx) for c in self.caches.values()], dim=1)


def block_digests(snapshot: torch.Tensor) -> list[str]:
    """sha256 of each block of a :meth:`PagedKV.snapshot` (all layers' bytes of the slot,
    layer by layer)."""
    raw = snapshot.contiguous().cpu().view(torch.uint8).reshape(snapshot.shape[0], -1).numpy()
    return [hashlib.sha256(row.tobytes()).hexdigest() for row in raw]


@dataclass
class StepItem:
    """One request's part of a step: ``ids`` fed at positions ``start...``, its block table
    ``slots`` (covering at least ``start + len(ids)`` positions), whether the last position's
    logits are wanted, and how many leading blocks to snapshot after the step (0: none)."""

    slots: Sequence[int]
    start: int
    ids: Sequence[int]
    sample: bool
    snapshot_blocks: int = 0


@dataclass
class StepResult:
    """The step's sampled rows, in item order: greedy tokens, logits ``[n, vocab]`` in the
    model's dtype (on the device) and the snapshots asked for (by item index)."""

    tokens: list[int]
    logits: torch.Tensor
    snapshots: dict[int, torch.Tensor] = field(default_factory=dict)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class PagedModel:
    """The model and the paged cache of one replica. Call :meth:`step` from one thread at
    a time (the replica runs it on its model thread)."""

    def __init__(self, shape: ModelShape, seed: int, device: torch.device, num_slots: int,
                 invariant: bool | None = None) -> None:
        from transformers import Qwen2ForCausalLM
        self.shape = shape
        self.device = device
        #: batch-invariant math (default: float32 on the CPU, where answers are compared exactly)
        self.invariant = (shape.torch_dtype == torch.float32 and device.type == "cpu"
                          if invariant is None else invariant)
        torch.manual_seed(seed)  # identical weights on every replica
        model: Any = Qwen2ForCausalLM(shape.config())
        self.model: Any = model.to(dtype=shape.torch_dtype, device=device).eval()
        self.kv = PagedKV(shape, num_slots, device)
        inner = self.model.model
        self._layers = list(inner.layers)
        # RoPE for every position a request can reach, from the model's own rotary module
        positions = torch.arange((num_slots + 1) * BLOCK, device=device)[None]
        probe = torch.zeros(1, dtype=shape.torch_dtype, device=device)
        with torch.no_grad():
            cos, sin = inner.rotary_emb(probe, positions)
        half = shape.head_dim // 2
        self._cos: torch.Tensor = cos[0]
        self._sin_signed: torch.Tensor = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        self._scale = shape.head_dim ** -0.5
        # one GEMM for Q, K and V per layer (the model's own weights, side by side)
        self._qkv_w = [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                       for a in (layer.self_attn for layer in self._layers)]
        self._qkv_b = [torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
                       for a in (layer.self_attn for layer in self._layers)]

    # -- one engine step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, items: Sequence[StepItem]) -> StepResult:
        """Run the step's token rows through every layer: write their K and V into the
        requests' slots, attend over each request's pages, and return the logits of the
        rows marked ``sample``, in item order. On CUDA the device work is complete when
        this returns (a block published after it is readable by a transfer)."""
        sh, dev = self.shape, self.device
        H, kvh, d = sh.heads, sh.kv_heads, sh.head_dim
        groups, order = self._groups(items)  # rows are packed group by group
        packed = [items[i] for i in order]
        n_rows = sum(len(it.ids) for it in items)
        rows = _round_up(max(n_rows, 1), ROW_ALIGN) if self.invariant else n_rows
        ids = [t for it in packed for t in it.ids] + [0] * (rows - n_rows)
        pos_list = [it.start + i for it in packed for i in range(len(it.ids))]
        slot_list = [it.slots[p // BLOCK] for it in packed for p in range(it.start, it.start + len(it.ids))]
        pos = torch.tensor(pos_list + [0] * (rows - n_rows), dtype=torch.long, device=dev)
        slot_idx = torch.tensor(slot_list, dtype=torch.long, device=dev)
        off_idx = pos[:n_rows] % BLOCK
        cos, sin = self._cos[pos][:, None], self._sin_signed[pos][:, None]   # [rows, 1, d]

        norm = self._norm
        h = self.model.model.embed_tokens(torch.tensor(ids, dtype=torch.long, device=dev))
        for li, layer in enumerate(self._layers):
            x = norm(layer.input_layernorm, h)
            qkv = torch.nn.functional.linear(x, self._qkv_w[li], self._qkv_b[li]).view(rows, H + 2 * kvh, d)
            qk = qkv[:, :H + kvh]
            # RoPE: x * cos + rotate_half(x) * sin, with rotate_half's sign folded into sin
            qkv[:, :H + kvh] = qk * cos + qk.roll(d // 2, dims=-1) * sin
            cache = self.kv.caches[li]
            cache[slot_idx, :, :, off_idx] = qkv[:n_rows, H:].view(n_rows, 2, kvh, d)
            q = qkv[:, :H]
            outs = [self._attend(cache, q[g.r0:g.r1], g) for g in groups]
            if rows > n_rows:
                outs.append(q.new_zeros(rows - n_rows, H * d))
            h = h + layer.self_attn.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))
            h = h + layer.mlp(norm(layer.post_attention_layernorm, h))

        last, at = {}, 0
        for i, it in zip(order, packed):
            at += len(it.ids)
            last[i] = at - 1
        sample_rows = [last[i] for i, it in enumerate(items) if it.sample]
        n_sample = len(sample_rows)
        pad = (_round_up(max(n_sample, 1), ROW_ALIGN) - n_sample) if self.invariant else 0
        sel = torch.tensor(sample_rows + [0] * pad, dtype=torch.long, device=dev)
        logits = self.model.lm_head(self.model.model.norm(h.index_select(0, sel)))[:n_sample]
        snapshots = {i: self.kv.snapshot(it.slots[:it.snapshot_blocks])
                     for i, it in enumerate(items) if it.snapshot_blocks}
        tokens: list[int] = logits.argmax(dim=-1).tolist() if n_sample else []
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return StepResult(tokens, logits, snapshots)

    def _norm(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm: its own module in batch-invariant mode (the CPU's exact
        comparisons), else one fused ``rms_norm`` over its weight (the module's eight
        launches per call made a GPU step launch-bound: 2,778 launches in three steps)."""
        if self.invariant:
            return module(x)  # type: ignore[no-any-return]
        return torch.nn.functional.rms_norm(x, module.weight.shape, module.weight,
                                            module.variance_epsilon)

    # -- attention over pages ---------------------------------------------------------------
    @dataclass
    class _Group:
        """Requests attended together: their rows ``r0:r1`` of the step, where each row
        goes in the padded query layout ``[n, q_len]`` (``None``: no padding), their block
        tables, and the mask (invariant mode: one contiguous
        ``[n, kv_heads, groups * q_len, ATTN_TILE]`` per tile; otherwise ``[n, 1, q_len, keys]``)."""

        r0: int
        r1: int
        dest: torch.Tensor | None
        n: int
        q_len: int
        table: torch.Tensor
        masks: list[torch.Tensor]

    def _groups(self, items: Sequence[StepItem]) -> tuple[list[PagedModel._Group], list[int]]:
        """Requests whose chunks have about the same length (the same power of two) are
        attended as one batch: decode tokens together, short chunks together, a long
        chunk with the long ones (padding wastes at most half of a group's queries).
        Returns the groups and the item order that makes each group's rows contiguous."""
        buckets: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            buckets.setdefault((len(it.ids) - 1).bit_length(), []).append(i)
        groups, order, at = [], [], 0
        for key in sorted(buckets):
            members = buckets[key]
            g = self._group([items[i] for i in members], at)
            groups.append(g)
            order += members
            at = g.r1
        return groups, order

    def _group(self, items: Sequence[StepItem], r0: int) -> PagedModel._Group:
        sh, dev = self.shape, self.device
        lengths = [len(it.ids) for it in items]
        q_len = max(lengths)
        n_blocks = -(-max(it.start + len(it.ids) for it in items) // BLOCK)
        groups = sh.heads // sh.kv_heads
        if self.invariant:  # groups * q_len rows per GEMM: a multiple of ROW_ALIGN
            q_len = _round_up(q_len, ROW_ALIGN // math.gcd(ROW_ALIGN, groups))
            n_blocks = _round_up(n_blocks, ATTN_TILE // BLOCK)
        table = [list(it.slots[:-(-(it.start + len(it.ids)) // BLOCK)]) for it in items]
        table = [t + [self.kv.scratch] * (n_blocks - len(t)) for t in table]
        padded = any(n != q_len for n in lengths)
        dest = [r * q_len + i for r, n in enumerate(lengths) for i in range(n)]
        # key j is visible to query i of a request iff j <= its position; padded queries see key 0
        qpos = torch.zeros(len(items), q_len, dtype=torch.long)
        for r, it in enumerate(items):
            qpos[r, :len(it.ids)] = torch.arange(it.start, it.start + len(it.ids))
        n = len(items)
        if self.invariant:
            masks = []
            for t0 in range(0, n_blocks * BLOCK, ATTN_TILE):
                vis = torch.arange(t0, t0 + ATTN_TILE)[None, None, :] <= qpos[:, :, None]  # [n, q, tile]
                masks.append(vis[:, None, None].expand(n, sh.kv_heads, groups, q_len, ATTN_TILE)
                             .reshape(n, sh.kv_heads, groups * q_len, ATTN_TILE).contiguous().to(dev))
        else:
            masks = [(torch.arange(n_blocks * BLOCK)[None, None, :] <= qpos[:, :, None])[:, None].to(dev)]
        return PagedModel._Group(
            r0=r0, r1=r0 + sum(lengths),
            dest=torch.tensor(dest, dtype=torch.long, device=dev) if padded else None, n=n, q_len=q_len,
            table=torch.tensor(table, dtype=torch.long, device=dev), masks=masks)

    def _attend(self, cache: torch.Tensor, q: torch.Tensor, g: PagedModel._Group) -> torch.Tensor:
        """Attention of the group's query rows ``q [rows, heads, d]`` over their pages;
        returns ``[rows, heads * d]`` in the same order."""
        sh = self.shape
        H, kvh, d, groups = sh.heads, sh.kv_heads, sh.head_dim, sh.heads // sh.kv_heads
        n, ql, nb = g.n, g.q_len, g.table.shape[1]
        L = nb * BLOCK
        kv = cache.index_select(0, g.table.reshape(-1)).view(n, nb, 2, kvh, BLOCK, d)
        kv = kv.permute(2, 0, 3, 1, 4, 5)                  # [2, n, kvh, nb, 16, d]
        if g.dest is not None:
            qp = q.new_zeros(n * ql, H, d)
            qp[g.dest] = q
            q = qp
        if self.invariant:
            k, v = kv.reshape(2, n, kvh, L, d)
            # query heads of one KV head side by side: [n, kvh, groups * q_len, d]
            qg = q.view(n, ql, kvh, groups, d).permute(0, 2, 3, 1, 4).reshape(n, kvh, groups * ql, d)
            o = self._tiled_attention(qg, k, v, g.masks)
            o = o.view(n, kvh, groups, ql, d).permute(0, 3, 1, 2, 4).reshape(n * ql, H * d)
        else:
            k, v = kv[:, :, :, None].expand(2, n, kvh, groups, nb, BLOCK, d).reshape(2, n, H, L, d)
            o = torch.nn.functional.scaled_dot_product_attention(
                q.view(n, ql, H, d).transpose(1, 2), k, v, attn_mask=g.masks[0], scale=self._scale)
            o = o.transpose(1, 2).reshape(n * ql, H * d)
        return o if g.dest is None else o[g.dest]

    def _tiled_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         masks: Sequence[torch.Tensor]) -> torch.Tensor:
        """Softmax attention in fixed tiles of ``ATTN_TILE`` keys from key 0, combined with
        an online softmax: every reduction has a fixed shape, and a tile wholly past a
        query's position changes nothing (its weights are exact zeros)."""
        neg = torch.tensor(-math.inf, dtype=q.dtype, device=q.device)
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        m = l = o = None
        for i, mt in enumerate(masks):
            kt, vt = k[:, :, i * ATTN_TILE:(i + 1) * ATTN_TILE], v[:, :, i * ATTN_TILE:(i + 1) * ATTN_TILE]
            s = (q @ kt.transpose(-1, -2)) * self._scale
            mc = torch.where(mt, s, neg).amax(dim=-1, keepdim=True)   # -inf: a wholly masked row
            # exp of the masked scores too, then zeros there (exp(-inf) is slow on the CPU)
            p = torch.where(mt, torch.exp(s - torch.where(torch.isinf(mc), zero, mc)), zero)
            lc = p.sum(dim=-1, keepdim=True)
            oc = p @ vt
            if m is None or l is None or o is None:
                m, l, o = mc, lc, oc
                continue
            m_new = torch.maximum(m, mc)
            a, b = torch.exp(m - m_new), torch.exp(mc - m_new)
            m, l, o = m_new, l * a + lc * b, o * a + oc * b
        assert o is not None and l is not None
        return o / l
