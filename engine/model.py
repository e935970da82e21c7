"""The Llama-family transformer over a flat token batch, with a preallocated paged KV cache.

One forward pass serves every scheduled sequence at once: prefill chunks and decodes share the
matrix products (rows of one flat batch); attention runs once for all decodes and once for all
prefill chunks, each padded to a common length and fed to `scaled_dot_product_attention`.
Notation: T tokens in the flat batch, D hidden size, H query heads, K kv heads, E head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from . import hugepages
from .kernels import Int4Linear, LayerOps, PagedAttention, QuantKernel, StepKernels
from .loader import ModelConfig, rope_inv_freq
from .matmul import MatmulPolicy
from .quant import Q4Weight

MIN_SPLIT_PREFILL = 64  # prompt chunks at least this long split their attention over two threads


@dataclass(slots=True)
class AttentionGroup:
    """Sequences whose queries are padded to one length Q for one attention call (B sequences)."""

    query_rows: torch.Tensor  # [B*Q] flat-batch row of each padded query (padding repeats a valid row)
    valid: torch.Tensor | None  # [B*Q] bool, False on padded queries; None when there is no padding
    kv_blocks: torch.Tensor  # [B, NB] block table of each sequence (0 on padding); C = NB * block_size
    mask: torch.Tensor | None  # [B, 1, Q, C] bool, True where a query may attend; None: attend to all
    out_start: int  # the group's valid queries are flat rows out_start .. out_start + num_valid - 1
    num_seqs: int
    max_q: int
    fresh: bool = False  # one sequence with nothing cached before these rows: causal over the new K/V
    lens: torch.Tensor | None = None  # [B] int64 context lengths (decode groups: for the native kernel)
    split: int = 0  # decode groups: sequences 0..split-1 and split..B-1 hold about half the context each


def fresh_group(row_start: int, num_tokens: int) -> AttentionGroup:
    """A prefill chunk that starts a sequence: attends causally to its own new K/V, no cache read."""
    return AttentionGroup(query_rows=torch.empty(0, dtype=torch.long), valid=None,
                          kv_blocks=torch.empty(0, dtype=torch.long), mask=None, out_start=row_start, num_seqs=1,
                          max_q=num_tokens, fresh=True)


@dataclass(slots=True)
class ForwardBatch:
    """Everything one forward pass needs; built by the runner from scheduled sequences."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    groups: list[AttentionGroup]
    logits_rows: torch.Tensor  # [S] rows whose next-token logits are wanted
    # rows start..end-1 run with a LoRA adapter (lora.LoraWeights); rows in no segment run the base model
    lora_segments: list[tuple[int, int, object]] = field(default_factory=list)
    # embedding requests: rows whose final hidden states (after the final norm) `forward` puts in `hidden` [R, D]
    hidden_rows: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    embeds: list[tuple[object, int]] = field(default_factory=list)  # (sequence, its rows in `hidden`), in row order


@dataclass(slots=True)
class ReusedBatch:
    """The model's last decode-only ForwardBatch, kept for the next step (runner.prepare_decodes): a step of the same
    `shape` (sequences, block-table width) refills `array`, which holds the values of every index tensor of `batch`."""

    shape: tuple[int, int] | None = None
    array: np.ndarray | None = None
    batch: ForwardBatch | None = None


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer, fused at load time: qkv [(H+2K)*E, D], o [D, H*E], gate_up [2I, D], down [D, I]."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, as transformers computes it (so outputs match bit for bit)."""
    if x.dtype != torch.bfloat16:  # the fused kernel gives the same bits in float32 and float64
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_lora(y: torch.Tensor, x: torch.Tensor, segments: list, layer: int, proj: str) -> torch.Tensor:
    """Add each segment's low-rank update to the projection output, in place: y[s:e] += (x[s:e] A^T) B^T.
    x: [T, D_in], y: [T, D_out], A^T: [D_in, R], B^T: [R, D_out]; one pair of small products per adapter in the
    batch (rows grouped by adapter). `addmm_` with the stored transposes took ~25 % less than two `F.linear`s
    and an add here (tiny products are all call overhead)."""
    for start, end, weights in segments:
        ab = weights.layers[layer].get(proj)
        if ab is not None:
            y[start:end].addmm_(x[start:end] @ ab[0], ab[1])
    return y


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout. x: [T, heads, E]; cos, sin: [T, 1, E]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Model:
    """Weights, rope tables and the KV cache of one model; `forward` runs a ForwardBatch."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 num_blocks: int, block_size: int, matmul: MatmulPolicy, paged: PagedAttention | None = None,
                 split_attention: bool = False, ops: LayerOps | None = None):
        self.config = config
        self.dtype = dtype
        self.matmul = matmul
        # decode attention straight from the paged cache (kernels.py); None: gather + SDPA in torch
        self.paged = paged if dtype == torch.float32 else None
        # RMSNorm, rope + cache write and SiLU * up in C (kernels.py); None: the same operations in torch
        self.ops = ops if dtype == torch.float32 else None
        self.split_attention = split_attention  # halve each decode batch over the matmul helper thread
        self.scale = config.head_dim ** -0.5
        self.embed = weights["embed"]  # [V, D]
        self.norm = weights["norm"]
        self.lm_head = weights["lm_head"]  # [V, D], the embedding itself when tied
        self.layers = [LayerWeights(
            weights[f"layers.{i}.input_norm"], weights[f"layers.{i}.qkv"], weights.get(f"layers.{i}.qkv_bias"),
            weights[f"layers.{i}.o"], weights[f"layers.{i}.post_norm"], weights[f"layers.{i}.gate_up"],
            weights[f"layers.{i}.down"]) for i in range(config.num_layers)]
        c = config
        self.block_size = block_size
        # k_cache, v_cache: [L, num_blocks * block_size, K, E]; slot = block_id * block_size + offset; on huge pages
        # like the weights (hugepages.py): attention streams them too
        cache_shape = (c.num_layers, num_blocks * block_size, c.num_kv_heads, c.head_dim)
        self.k_cache = hugepages.zeros(cache_shape, dtype)
        self.v_cache = hugepages.zeros(cache_shape, dtype)
        # cos, sin: [max_context, E], computed in float32 like transformers, then cast
        pos = torch.arange(c.max_context_length, dtype=torch.float32)
        freqs = pos[:, None] * rope_inv_freq(c)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        # every layer of a decode or prefill step in one C call (layer_ops.c, decode_step_f32): the per-weight pointers,
        # built once here; None where the weights are not all quantized or the native ops / attention are missing
        self._plan_args = (c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, self.scale, block_size)
        self.plan = ops.decode_plan(self.layers, self.k_cache, self.v_cache, self.cos, self.sin, *self._plan_args) \
            if self.ops is not None and self.paged is not None else None
        self._packed_plans: dict[int, object] = {}  # by id(Int4Linear.packings): the plan over that x22 packing
        if self.plan is not None:  # pack the int4 weights for an x22 route now, not in the first request
            for route, _ in set(matmul.qroutes.values()):
                self._plan_for(route.int4)
        self.fuse_decode = True  # False: decode steps take the per-operation path too (tests and benchmarks)
        self.reused_batch = ReusedBatch()  # runner.run's decode-only batch, refilled step after step
        self._embed_np = self.embed.numpy() if self.plan is not None else None  # [V, D]: fused steps' embeddings
        self._decode_rows: tuple[torch.Tensor, np.ndarray, torch.Tensor] | None = None  # _forward_fused's h, x
        self._step_kernels: dict[tuple[object, bool], StepKernels | None] = {}  # by (QuantRoute, split)

    @classmethod
    def kv_bytes_per_token(cls, config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the batch, write its K/V into the cache; returns float32 logits [S, V]. A step that one C call covers
        (fused_kernels) runs outside inference mode: its C calls write preallocated rows and it records nothing for
        autograd (entering the mode took ~40 us of a one-stream step)."""
        kernels = self.fused_kernels(batch) if self.ops is not None else None
        if kernels is not None:
            return self._forward_fused(batch, kernels)
        return self._forward(batch)

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """`forward` for every step the fused call does not cover."""
        if self.ops is not None:
            return self._forward_ops(batch)
        c, num_tokens = self.config, batch.input_ids.shape[0]
        backend = self.matmul.backend(num_tokens)
        linear = self.matmul.linear
        loras = batch.lora_segments
        h = self.embed[batch.input_ids]  # [T, D]
        cos = self.cos[batch.positions].unsqueeze(1)  # [T, 1, E]
        sin = self.sin[batch.positions].unsqueeze(1)
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w.input_norm, c.rms_norm_eps)
            qkv = linear(x, w.qkv, backend)  # [T, (H+2K)*E]
            if loras:
                add_lora(qkv, x, loras, i, "qkv")
            if w.qkv_bias is not None:
                qkv = qkv + w.qkv_bias
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = rotate(qk.view(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)  # [T, H+K, E]
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)  # [T, H, E], [T, K, E]
            self.k_cache[i].index_copy_(0, batch.slot_mapping, k)
            self.v_cache[i].index_copy_(0, batch.slot_mapping, v.view(num_tokens, c.num_kv_heads, c.head_dim))
            attn = self._attention(i, q, k, v.view(num_tokens, c.num_kv_heads, c.head_dim), batch.groups)
            o = linear(attn, w.o, backend)
            h = h + (add_lora(o, attn, loras, i, "o") if loras else o)
            x = rms_norm(h, w.post_norm, c.rms_norm_eps)
            gate_up = linear(x, w.gate_up, backend)
            gate, up = (add_lora(gate_up, x, loras, i, "gate_up") if loras else gate_up).chunk(2, dim=-1)  # [T, I]
            act = (F.silu(gate) * up).contiguous()
            down = linear(act, w.down, backend)
            h = h + (add_lora(down, act, loras, i, "down") if loras else down)
        self._final_hidden(h, batch)
        x = rms_norm(h[batch.logits_rows], self.norm, c.rms_norm_eps)  # [S, D]
        return linear(x, self.lm_head, self.matmul.backend(x.shape[0])).float()  # [S, V]

    def fused_kernels(self, batch: ForwardBatch) -> StepKernels | None:
        """What runs `batch` in one C call (layer_ops.c, decode_step_f32), or None when it takes the per-operation
        path: a step with LoRA rows or an attention group the decode kernel does not take (a prefill chunk past
        runner.PAGED_PREFILL_CONTEXT: torch's SDPA), weights that are not all quantized, or a route that is not
        one of the engine's batch-invariant C kernel families (exact float32 activations, or int4's x22; not the
        torch routes nor vnni). `kernels.plan` is the plan over the weight layout the route's int4 path reads."""
        if self.plan is None or not self.fuse_decode or batch.lora_segments:
            return None
        for g in batch.groups:
            if g.max_q != 1 or g.lens is None:
                return None
        route, split = self.matmul.route(batch.input_ids.shape[0])
        key = (route, split)
        if key not in self._step_kernels:
            kernels = {0: route.int8, 1: route.int4}
            fusable = {0: QuantKernel.EXACT, 1: QuantKernel.EXACT + Int4Linear.X22}
            usable = all(kernels[kind] is not None and kernels[kind].isa in fusable[kind]
                         for kind in self.plan.kinds) and not route.family.startswith("torch")
            step = StepKernels(route.int8, route.int4, split, self.paged, self.split_attention) if usable else None
            if step is not None:
                step.plan = self._plan_for(route.int4)
            self._step_kernels[key] = step
        return self._step_kernels[key]

    def _plan_for(self, int4: Int4Linear | None):
        """The fused plan for products on `int4`'s path: the model's own, or, for an x22 path, one over the packing
        that path multiplies (Int4Linear.packed: one more copy of the int4 weights, shared with the per-operation
        path's products), built on first use. The x22 routes of one calibration share their packings, so they share
        one plan (the path codes are the StepKernels'): the weights are packed and placed once."""
        if int4 is None or int4.isa not in Int4Linear.X22:
            return self.plan
        plan = self._packed_plans.get(id(int4.packings))
        if plan is None:
            q4 = [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
                  if isinstance(w, Q4Weight)]
            int4.pack_all(q4, hugepages.arena_for([w.q.numel() * w.q.element_size() for w in q4]))
            plan = self._packed_plans[id(int4.packings)] = self.ops.decode_plan(
                self.layers, self.k_cache, self.v_cache, self.cos, self.sin, *self._plan_args,
                int4_operands=int4.packed)
        return plan

    def _forward_fused(self, batch: ForwardBatch, kernels: StepKernels) -> torch.Tensor:
        """`_forward_ops` for a step of one-query attention groups (decodes, and prompt chunks on the decode kernel),
        every layer in one C call: the same functions in the same order (layer_ops.c, decode_step_f32), so the same
        bits."""
        num_tokens = batch.input_ids.shape[0]
        if self._decode_rows is None or self._decode_rows[0].shape[0] != num_tokens:
            h = torch.empty(num_tokens, self.config.hidden_size)
            self._decode_rows = (h, h.numpy(), torch.empty_like(h))
        h, h_np, x = self._decode_rows  # [T, D] each, reused while T stays: h is the residual stream, x its norm
        np.take(self._embed_np, batch.input_ids.numpy(), axis=0, out=h_np)  # the embeddings, updated in place
        self.ops.decode_step(kernels.plan, kernels, h, batch.positions, batch.slot_mapping, batch.groups)
        return self._logits(h, batch, x)

    def _logits(self, h: torch.Tensor, batch: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and lm_head over the rows that sample (C RMSNorm); the embedding rows' hidden states.
        `out` [T, D]: where the norm may go when every row samples."""
        self._final_hidden(h, batch)
        # [S, D]; every row samples (a decode-only step): h itself (the norm writes x)
        every = batch.logits_rows.shape[0] == h.shape[0]
        rows = h if every else h[batch.logits_rows]
        x = out if every and out is not None else torch.empty_like(rows)
        self.ops.add_rms_norm(rows, None, self.norm, self.config.rms_norm_eps, x)
        logits = self.matmul.linear(x, self.lm_head, self.matmul.backend(x.shape[0]))  # [S, V]
        return logits if logits.dtype is torch.float32 else logits.float()

    def _forward_ops(self, batch: ForwardBatch) -> torch.Tensor:
        """`forward` with the layer's small operations in C (layer_ops.c): the residual stream h is updated in place
        and each residual add is fused into the RMSNorm after it. The same operations, in the same order."""
        c, num_tokens = self.config, batch.input_ids.shape[0]
        backend = self.matmul.backend(num_tokens)
        linear, ops, eps = self.matmul.linear, self.ops, c.rms_norm_eps
        loras = batch.lora_segments
        h = self.embed[batch.input_ids]  # [T, D], a new tensor: updated in place below
        x = torch.empty_like(h)
        heads, kv_heads, head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        # the rotated queries in contiguous rows, written by rope_store, for the native decode attention (no copy)
        paged_q = torch.empty(num_tokens, heads, head_dim) if self.paged is not None and \
            any(g.max_q == 1 and g.lens is not None for g in batch.groups) else None
        delta = None  # the last layer's output, added to h by the next RMSNorm
        for i, w in enumerate(self.layers):
            ops.add_rms_norm(h, delta, w.input_norm, eps, x)
            qkv = linear(x, w.qkv, backend)  # [T, (H+2K)*E]
            if loras:
                add_lora(qkv, x, loras, i, "qkv")
            if w.qkv_bias is not None:
                qkv = qkv + w.qkv_bias
            ops.rope_store(qkv, heads, kv_heads, head_dim, self.cos, self.sin, batch.positions, batch.slot_mapping,
                           self.k_cache[i], self.v_cache[i], paged_q)
            q = qkv[:, :q_end].view(num_tokens, heads, head_dim)
            k = qkv[:, q_end:k_end].view(num_tokens, kv_heads, head_dim)
            v = qkv[:, k_end:].view(num_tokens, kv_heads, head_dim)
            attn = self._attention(i, q, k, v, batch.groups, paged_q)
            o = linear(attn, w.o, backend)
            ops.add_rms_norm(h, add_lora(o, attn, loras, i, "o") if loras else o, w.post_norm, eps, x)
            gate_up = linear(x, w.gate_up, backend)
            if loras:
                add_lora(gate_up, x, loras, i, "gate_up")
            act = torch.empty(num_tokens, gate_up.shape[1] // 2)
            ops.silu_mul(gate_up, act)
            down = linear(act, w.down, backend)
            delta = add_lora(down, act, loras, i, "down") if loras else down
        h.add_(delta)
        return self._logits(h, batch)

    def _final_hidden(self, h: torch.Tensor, batch: ForwardBatch) -> None:
        """The embedding rows' hidden states after the final norm (transformers' last_hidden_state) into
        `batch.hidden`."""
        if batch.hidden_rows is not None:
            batch.hidden = rms_norm(h[batch.hidden_rows], self.norm, self.config.rms_norm_eps)

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Copy whole blocks (index_select on [num_blocks, block_size*K*E] rows is ~5x faster than
        indexing slot by slot). cache: [slots, K, E], blocks: [B, NB] -> [B, K, NB*block_size, E]."""
        num_seqs, num_blocks = blocks.shape
        rows = cache.view(-1, self.block_size * cache.shape[1] * cache.shape[2])
        out = rows.index_select(0, blocks.flatten())
        return out.view(num_seqs, num_blocks * self.block_size, cache.shape[1], cache.shape[2]).transpose(1, 2)

    def _attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   groups: list[AttentionGroup], paged_q: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of every query over its sequence's context. q: [T, H, E], k, v: [T, K, E] -> [T, H*E].
        paged_q: q's values in contiguous rows (rope_store writes them), which the decode kernel reads in place."""
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype)
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        for g in groups:
            if g.max_q == 1 and g.lens is not None and self.paged is not None:
                self._paged_decode(layer, q if paged_q is None else paged_q, out, g)
                continue
            if g.fresh:  # prefill from position 0: the chunk's own K/V, causal
                self._fresh_prefill(q, k, v, out, g)
                continue
            qg = q[g.query_rows].view(g.num_seqs, g.max_q, num_heads, head_dim).transpose(1, 2)  # [B, H, Q, E]
            kg = self._gather(k_cache, g.kv_blocks)  # [B, K, C, E]
            vg = self._gather(v_cache, g.kv_blocks)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, enable_gqa=True)  # [B, H, Q, E]
            og = og.transpose(1, 2).reshape(g.num_seqs * g.max_q, num_heads * head_dim)
            if g.valid is not None:
                og = og[g.valid]
            out[g.out_start:g.out_start + og.shape[0]] = og
        return out

    def _fresh_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       g: AttentionGroup) -> None:
        """Causal attention of a prompt chunk over itself. Long chunks split their queries over two threads:
        rows [0, m) attend causally to keys [0, m), rows [m, n) to keys [0, n) with a lower-right causal mask;
        m = n / sqrt(2) gives both parts the same work."""
        n, num_heads, head_dim = g.max_q, q.shape[1], q.shape[2]
        start = g.out_start
        qg, kg, vg = (x[start:start + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, n, E]

        def part(lo: int, hi: int):
            def run():
                with torch.inference_mode():  # also on the helper thread: `out` is an inference tensor
                    mask = None if lo == 0 else (torch.arange(hi)[None, :] <= torch.arange(lo, hi)[:, None])
                    og = F.scaled_dot_product_attention(qg[:, :, lo:hi], kg[:, :, :hi], vg[:, :, :hi],
                                                        attn_mask=mask, is_causal=lo == 0, enable_gqa=True)
                    out[start + lo:start + hi] = og[0].transpose(0, 1).reshape(hi - lo, num_heads * head_dim)
            return run

        if self.split_attention and n >= MIN_SPLIT_PREFILL:
            m = int(n / 2 ** 0.5)
            self.matmul.helper().split(part(0, m), part(m, n))
        else:
            part(0, n)()

    def _paged_decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, g: AttentionGroup) -> None:
        """One query per sequence, flat rows out_start.. : the native kernel reads the cache in place."""
        end = g.out_start + g.num_seqs
        qd = q[g.out_start:end]  # [B, H, E]
        if not qd.is_contiguous():  # a view of qkv's rows (the caller had no contiguous copy)
            qd = qd.contiguous()
        od = out[g.out_start:end].view(g.num_seqs, q.shape[1], q.shape[2])  # contiguous rows of `out`: in place
        args = (qd, od, self.k_cache[layer], self.v_cache[layer], g.kv_blocks, g.lens)
        if self.split_attention and 0 < g.split < g.num_seqs:
            self.matmul.helper().split(partial(self.paged.decode, *args, 0, g.split, self.block_size, self.scale),
                                       partial(self.paged.decode, *args, g.split, g.num_seqs, self.block_size,
                                               self.scale))
        else:
            self.paged.decode(*args, 0, g.num_seqs, self.block_size, self.scale)
