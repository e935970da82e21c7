"""The Llama-family transformer over a flat token batch (batch.ForwardBatch), with a preallocated paged KV cache.

One forward pass serves every scheduled sequence at once: prefill chunks and decodes share the
matrix products (rows of one flat batch); attention runs per group (batch.AttentionGroup): one-query groups on the
native decode kernel, others padded to a common length and fed to `scaled_dot_product_attention`.
Notation: T tokens in the flat batch, D hidden size, H query heads, K kv heads, E head dim, I intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from . import hugepages
from .batch import AttentionGroup, ForwardBatch, ReusedBatch
from .layer_kernels import LayerOps, PagedAttention, PlanShape, StepKernels
from .linear_kernels import Int4Linear, QuantKernel
from .loader import ModelConfig, rope_inv_freq
from .matmul import MatmulPolicy
from .quant import Q4Weight, embedding_rows
from .torch_ops import TorchLayerOps, rms_norm

MIN_SPLIT_PREFILL = 64  # prompt chunks at least this long split their attention over two threads
TORCH_OPS = TorchLayerOps()  # the layer operations of a model without the C ones


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
    q_norm: torch.Tensor | None = None  # [E], Qwen3's and Gemma 3's per-head query and key norms (ModelConfig.qk_norm)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [D], Gemma 3: the attention's and the MLP's outputs, normalized
    post_ff_norm: torch.Tensor | None = None


def layer_windows(config: ModelConfig) -> list[int]:
    """Each layer's sliding window (attend to the last `window` positions, its own included; 0: every position):
    Gemma 3's local layers, every Mistral layer, Qwen2 / Qwen3's from max_window_layers on (loader.sliding_layers)."""
    if config.local_layers is None or not config.sliding_window:
        return [0] * config.num_layers
    return [config.sliding_window if local else 0 for local in config.local_layers]


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


class Model:
    """Weights, rope tables and the KV cache of one model; `forward` runs a ForwardBatch."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 num_blocks: int, block_size: int, matmul: MatmulPolicy, paged: PagedAttention | None = None,
                 split_attention: bool = False, ops: LayerOps | None = None, kv_dtype: torch.dtype | None = None):
        self.config = config
        self.dtype = dtype
        # the KV cache's dtype: the activations' (fp32's reference), or float16 (the quantized modes' 16-bit cache)
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.matmul = matmul
        # decode attention straight from the paged cache (kernels.py); None: gather + SDPA in torch
        self.paged = paged if dtype == torch.float32 else None
        # RMSNorm, rope + cache write and SiLU * up in C (kernels.py); None: the same operations in torch
        self.ops = ops if dtype == torch.float32 else None
        self.split_attention = split_attention  # halve each decode batch over the matmul helper thread
        self.scale = config.attn_scale or config.head_dim ** -0.5
        self.sdpa_scale = config.attn_scale  # None: SDPA's own 1/sqrt(E)
        self.embed_scale = None if config.embed_scale is None else torch.tensor(config.embed_scale, dtype=dtype)
        self.embed = weights["embed"]  # [V, D]: a tensor, or the int8 lm_head's QWeight (quant.embedding_rows)
        self.norm = weights["norm"]
        self.lm_head = weights["lm_head"]  # [V, D], the embedding itself when tied
        self.layers = [LayerWeights(
            weights[f"layers.{i}.input_norm"], weights[f"layers.{i}.qkv"], weights.get(f"layers.{i}.qkv_bias"),
            weights[f"layers.{i}.o"], weights[f"layers.{i}.post_norm"], weights[f"layers.{i}.gate_up"],
            weights[f"layers.{i}.down"], weights.get(f"layers.{i}.q_norm"), weights.get(f"layers.{i}.k_norm"),
            weights.get(f"layers.{i}.post_attn_norm"), weights.get(f"layers.{i}.post_ff_norm"))
            for i in range(config.num_layers)]
        c = config
        self.block_size, self.num_blocks = block_size, num_blocks
        # k_cache, v_cache: [L, num_blocks * block_size, K, E]; slot = block_id * block_size + offset; on huge pages
        # like the weights (hugepages.py): attention streams them too
        cache_shape = (c.num_layers, num_blocks * block_size, c.num_kv_heads, c.head_dim)
        self.k_cache = hugepages.zeros(cache_shape, self.kv_dtype)
        self.v_cache = hugepages.zeros(cache_shape, self.kv_dtype)
        # cos, sin: [max_context, E], computed in float32 like transformers, then cast
        pos = torch.arange(c.max_context_length, dtype=torch.float32)
        freqs = pos[:, None] * rope_inv_freq(c)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.local_rope = None  # Gemma 3's sliding-window layers: their own (cos, sin)
        if c.local_rope_theta is not None:
            freqs = pos[:, None] * rope_inv_freq(c, local=True)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.local_rope = (emb.cos().to(dtype), emb.sin().to(dtype))
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.windows = layer_windows(c)  # per layer: attend to the last `window` positions only (0: all)
        self._window_masks: dict[int, torch.Tensor] = {}  # a step's attention groups' masks under the window
        # every layer of a decode or prefill step in one C call (layer_ops.c, decode_step_f32): the per-weight pointers,
        # built once here; None where the weights are not all quantized or the native ops / attention are missing
        self._plan_shape = PlanShape([self._rope(i) for i in range(c.num_layers)], self.windows, c.num_heads,
                                     c.num_kv_heads, c.head_dim, c.rms_norm_eps, self.scale, block_size,
                                     gelu=c.hidden_act != "silu")
        self.plan = ops.decode_plan(self.layers, self.k_cache, self.v_cache, self._plan_shape) \
            if self.ops is not None and self.paged is not None else None
        self._packed_plans: dict[int, object] = {}  # by id(Int4Linear.packings): the plan over that x22 packing
        if self.plan is not None:  # pack the int4 weights for an x22 route now, not in the first request
            for route, _ in set(matmul.qroutes.values()):
                self.plan_for(route.int4)
        self.fuse_decode = True  # False: every step takes the layer loop (tests and benchmarks)
        self.reused_batch = ReusedBatch()  # runner.prepare's plain-decode batch, refilled step after step
        self._embed_np = self.embed.numpy() if self.plan is not None and isinstance(self.embed, torch.Tensor) \
            else None  # [V, D]: the fused steps' embeddings, gathered by numpy
        # the fused step's residual rows h, h's numpy view, and x (the final norm's rows), reused while T stays
        self.fused_rows: tuple[torch.Tensor, np.ndarray, torch.Tensor] | None = None
        self._step_kernels: dict[tuple[object, bool], StepKernels | None] = {}  # by (QuantRoute, split)

    def _rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s rotary tables (cos, sin) [max_context, E]: Gemma 3's local layers have their own."""
        local = self.local_rope is not None and self.config.local_layers[layer]
        return self.local_rope if local else (self.cos, self.sin)

    @classmethod
    def kv_bytes_per_token(cls, config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the batch, write its K/V into the cache; returns float32 logits [S, V].

        Every step runs the same decoder layers (`_layer`) over the residual stream, on the C operations
        (kernels.LayerOps) or their torch twins (torch_ops). Fast path: a step that one C call covers
        (`fused_kernels`) runs every layer in that call (layer_ops.c, decode_step_f32: the same functions in the same
        order, so the same bits) over residual rows reused while T stays, outside inference mode: its C calls write
        preallocated rows and record nothing for autograd (entering the mode took ~40 us of a one-stream step)."""
        fused = self.fused_kernels(batch)
        if fused is not None:  # fast path: every layer in one C call
            h, x = self._fused_rows(batch)
            if self.embed_scale is not None:  # Gemma 3: embeddings times sqrt(D), as the layer loop scales them
                h.mul_(self.embed_scale)
            self.ops.decode_step(fused.plan, fused, h, batch.positions, batch.slot_mapping, batch.groups)
            return self._logits(h, batch, self.ops, x)
        with torch.inference_mode():
            ops = self.ops if self.ops is not None else TORCH_OPS
            h = embedding_rows(self.embed, batch.input_ids)  # [T, D], the residual stream: a new tensor, updated in place
            if self.embed_scale is not None:  # Gemma 3: embeddings times sqrt(D)
                h.mul_(self.embed_scale)
            x = torch.empty_like(h) if self.ops is not None else None  # the norms' rows, which the C ops write
            # the rotated queries in contiguous rows, written by rope_store, for the native decode kernel (no copy)
            paged_q = torch.empty(h.shape[0], self.config.num_heads, self.config.head_dim) \
                if self.paged is not None and any(g.one_query for g in batch.groups) else None
            backend = self.matmul.backend(h.shape[0])
            delta = None  # each layer's output, added to h by the next layer's first norm
            self._window_masks.clear()
            for i in range(len(self.layers)):
                delta = self._layer(i, h, delta, x, batch, ops, backend, paged_q)
            h.add_(delta)
            return self._logits(h, batch, ops)

    def _layer(self, i: int, h: torch.Tensor, delta: torch.Tensor | None, x: torch.Tensor | None,
               batch: ForwardBatch, ops: LayerOps | TorchLayerOps, backend, paged_q: torch.Tensor | None) -> torch.Tensor:
        """Decoder layer i: h [T, D] += delta (the layer before's output), then attention and the MLP, the attention's
        output added to h in place; returns the MLP's output [T, D] (the next norm adds it). x: the norms' output
        rows (the C ops write them; None with the torch ops)."""
        c, w, linear, loras = self.config, self.layers[i], self.matmul.linear, batch.lora_segments
        num_tokens, eps = h.shape[0], c.rms_norm_eps
        x = ops.add_rms_norm(h, delta, w.input_norm, eps, x)
        qkv = linear(x, w.qkv, backend)  # [T, (H+2K)*E]
        if loras:
            add_lora(qkv, x, loras, i, "qkv")
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        if w.q_norm is not None:  # Qwen3, Gemma 3: each query and key head normalized, then rotated
            ops.rms_norm_heads(qkv, c.num_heads, c.num_kv_heads, c.head_dim, w.q_norm, w.k_norm, eps)
        cos, sin = self._rope(i)
        ops.rope_store(qkv, c.num_heads, c.num_kv_heads, c.head_dim, cos, sin, batch.positions,
                       batch.slot_mapping, self.k_cache[i], self.v_cache[i], paged_q)  # in place, K/V cached
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q = qkv[:, :q_end].view(num_tokens, c.num_heads, c.head_dim)  # [T, H, E]
        k = qkv[:, q_end:k_end].view(num_tokens, c.num_kv_heads, c.head_dim)  # [T, K, E]
        v = qkv[:, k_end:].view(num_tokens, c.num_kv_heads, c.head_dim)
        attn = self.attention(i, q, k, v, batch.groups, paged_q)  # [T, H*E]
        o = linear(attn, w.o, backend)
        o = add_lora(o, attn, loras, i, "o") if loras else o
        if w.post_attn_norm is not None:  # Gemma 3: the attention's output normalized before the residual add
            o = ops.add_rms_norm(o, None, w.post_attn_norm, eps)
        x = ops.add_rms_norm(h, o, w.post_norm, eps, x)
        gate_up = linear(x, w.gate_up, backend)  # [T, 2I]
        if loras:
            add_lora(gate_up, x, loras, i, "gate_up")
        act = ops.silu_mul(gate_up) if c.hidden_act == "silu" else ops.gelu_mul(gate_up)  # [T, I]; Gemma 3: GeGLU
        down = linear(act, w.down, backend)
        down = add_lora(down, act, loras, i, "down") if loras else down
        return down if w.post_ff_norm is None else ops.add_rms_norm(down, None, w.post_ff_norm, eps)

    def _fused_rows(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused step's residual rows h [T, D], filled with the batch's embeddings, and rows x [T, D] for the final
        norm: both reused while T stays (`fused_rows`)."""
        num_tokens = batch.input_ids.shape[0]
        if self.fused_rows is None or self.fused_rows[0].shape[0] != num_tokens:
            h = torch.empty(num_tokens, self.config.hidden_size)
            self.fused_rows = (h, h.numpy(), torch.empty_like(h))
        h, h_np, x = self.fused_rows
        if self._embed_np is not None:
            np.take(self._embed_np, batch.input_ids.numpy(), axis=0, out=h_np)  # the embeddings, in place
        else:
            h.copy_(embedding_rows(self.embed, batch.input_ids))
        return h, x

    def _logits(self, h: torch.Tensor, batch: ForwardBatch, ops: LayerOps | TorchLayerOps,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and lm_head over the rows that sample; the embedding rows' hidden states. `out` [T, D]:
        where the norm may go when every row samples."""
        self._final_hidden(h, batch)
        every = batch.logits_rows.shape[0] == h.shape[0]  # a decode-only step: h itself, no gather
        rows = h if every else h[batch.logits_rows]  # [S, D]
        x = ops.add_rms_norm(rows, None, self.norm, self.config.rms_norm_eps, out if every else None)
        logits = self.matmul.linear(x, self.lm_head, self.matmul.backend(x.shape[0]))  # [S, V]
        return logits if logits.dtype is torch.float32 else logits.float()

    def fused_kernels(self, batch: ForwardBatch) -> StepKernels | None:
        """What runs `batch` in one C call (layer_ops.c, decode_step_f32), or None when it takes the layer loop: a
        step with LoRA rows or an attention group the decode kernel does not take (a prefill chunk past
        runner.PAGED_PREFILL_CONTEXT: torch's SDPA), a model without the C ops, weights that are not all quantized, or a route that is not
        one of the engine's batch-invariant C kernel families (exact float32 activations, or int4's x22; not the
        torch routes nor vnni). `kernels.plan` is the plan over the weight layout the route's int4 path reads."""
        if self.plan is None or self.ops is None or not self.fuse_decode or batch.lora_segments:
            return None
        for g in batch.groups:
            if not g.one_query:
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
                step.plan = self.plan_for(route.int4)
            self._step_kernels[key] = step
        return self._step_kernels[key]

    def plan_for(self, int4: Int4Linear | None):
        """The fused plan for products on `int4`'s path: the model's own, or, for an x22 path, one over the packing
        that path multiplies, built on first use: the int4 weights are repacked in place (Q4Weight.repack_vnni, in
        their huge-page arena: one copy of the weights, not two), shared with the layer loop's products. The x22
        routes of one calibration share their packings, so they share one plan (the path codes are the
        StepKernels')."""
        if int4 is None or int4.isa not in Int4Linear.X22:
            if self.plan is not None and any(w.q.dim() == 4 for w in self._q4_weights()):
                raise RuntimeError(f"the int4 weights were repacked for the x22 paths; route {int4.isa} reads the "
                                   "block layout (one family serves a process: matmul.MatmulPolicy)")
            return self.plan
        plan = self._packed_plans.get(id(int4.packings))
        if plan is None:
            int4.pack_all(self._q4_weights())
            plan = self._packed_plans[id(int4.packings)] = self.ops.decode_plan(
                self.layers, self.k_cache, self.v_cache, self._plan_shape, int4_operands=int4.packed)
        return plan

    def _q4_weights(self) -> list[Q4Weight]:
        return [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
                if isinstance(w, Q4Weight)]

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

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   groups: list[AttentionGroup], paged_q: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of every query over its sequence's context. q: [T, H, E], k, v: [T, K, E] -> [T, H*E].
        paged_q: q's values in contiguous rows (rope_store writes them), which the decode kernel reads in place."""
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype)
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        window = self.windows[layer]
        for g in groups:
            if g.one_query and self.paged is not None:
                self.paged_decode(layer, q if paged_q is None else paged_q, out, g)
                continue
            if g.fresh:  # prefill from position 0: the chunk's own K/V, causal
                self._fresh_prefill(q, k, v, out, g, window)
                continue
            qg = q[g.query_rows].view(g.num_seqs, g.max_q, num_heads, head_dim).transpose(1, 2)  # [B, H, Q, E]
            kg = self._gather(k_cache, g.kv_blocks).to(q.dtype)  # [B, K, C, E], widened from a 16-bit cache
            vg = self._gather(v_cache, g.kv_blocks).to(q.dtype)
            mask = self._window_mask(g, kg.shape[2], window) if window else g.mask
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, enable_gqa=True,
                                                scale=self.sdpa_scale)  # [B, H, Q, E]
            og = og.transpose(1, 2).reshape(g.num_seqs * g.max_q, num_heads * head_dim)
            if g.valid is not None:
                og = og[g.valid]
            out[g.out_start:g.out_start + og.shape[0]] = og
        return out

    def _window_mask(self, g: AttentionGroup, context: int, window: int) -> torch.Tensor:
        """g's mask [B, 1, Q, C] under a sliding window: a query at position p attends to positions p - window + 1
        .. p. The query's position is its causal mask's last True (all C keys when the group has no mask); built
        once per step and group."""
        mask = self._window_masks.get(id(g))
        if mask is None:
            pos = torch.arange(context)  # [C]
            causal = g.mask if g.mask is not None else torch.ones(g.num_seqs, 1, g.max_q, context, dtype=torch.bool)
            q_pos = causal.sum(-1, keepdim=True) - 1  # [B, 1, Q, 1]
            mask = self._window_masks[id(g)] = causal & (pos > q_pos - window)
        return mask

    def _fresh_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       g: AttentionGroup, window: int = 0) -> None:
        """Causal attention of a prompt chunk over itself (each query over the last `window` positions only, when
        given and shorter than the chunk). Long chunks split their queries over two threads: rows [0, m) attend
        causally to keys [0, m), rows [m, n) to keys [0, n) with a lower-right causal mask; m = n / sqrt(2) gives
        both parts the same work."""
        n, num_heads, head_dim = g.max_q, q.shape[1], q.shape[2]
        start = g.out_start
        windowed = 0 < window < n
        qg, kg, vg = (x[start:start + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, n, E]
        if self.kv_dtype != q.dtype:  # K/V as the 16-bit cache holds them, as every later step reads them
            kg, vg = kg.to(self.kv_dtype).to(q.dtype), vg.to(self.kv_dtype).to(q.dtype)

        def part(lo: int, hi: int):
            def run():
                with torch.inference_mode():  # also on the helper thread: `out` is an inference tensor
                    mask = None
                    if lo > 0 or windowed:  # [hi - lo, hi]: key c for query p when p - window < c <= p
                        keys, queries = torch.arange(hi)[None, :], torch.arange(lo, hi)[:, None]
                        mask = (keys <= queries) & (keys > queries - window) if windowed else keys <= queries
                    og = F.scaled_dot_product_attention(qg[:, :, lo:hi], kg[:, :, :hi], vg[:, :, :hi],
                                                        attn_mask=mask, is_causal=mask is None, enable_gqa=True,
                                                        scale=self.sdpa_scale)
                    out[start + lo:start + hi] = og[0].transpose(0, 1).reshape(hi - lo, num_heads * head_dim)
            return run

        if self.split_attention and n >= MIN_SPLIT_PREFILL:
            m = int(n / 2 ** 0.5)
            self.matmul.helper().split(part(0, m), part(m, n))
        else:
            part(0, n)()

    def paged_decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, g: AttentionGroup) -> None:
        """One query per sequence, flat rows out_start.. : the native kernel reads the cache in place."""
        end = g.out_start + g.num_seqs
        qd = q[g.out_start:end]  # [B, H, E]
        if not qd.is_contiguous():  # a view of qkv's rows (the caller had no contiguous copy)
            qd = qd.contiguous()
        od = out[g.out_start:end].view(g.num_seqs, q.shape[1], q.shape[2])  # contiguous rows of `out`: in place
        args = (qd, od, self.k_cache[layer], self.v_cache[layer], g.kv_blocks, g.lens)
        window = self.windows[layer]
        if self.split_attention and 0 < g.split < g.num_seqs:
            self.matmul.helper().split(partial(self.paged.decode, *args, 0, g.split, self.block_size, self.scale,
                                               window=window),
                                       partial(self.paged.decode, *args, g.split, g.num_seqs, self.block_size,
                                               self.scale, window=window))
        else:
            self.paged.decode(*args, 0, g.num_seqs, self.block_size, self.scale, window=window)
