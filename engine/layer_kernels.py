"""ctypes bindings of the decoder layer's kernels: paged_attention.c (PagedAttention: decode attention over the paged
KV cache) and layer_ops.c (LayerOps: RMSNorm, rope + cache write, SiLU or GeLU * up, the q/k heads' RMSNorm, and
decode_step_f32, every layer of a step in one call, with its StepKernels and DecodePlan). Built and loaded by kernels.py."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from .kernel_lib import CodePaths, address, bind_function, set_spin_us
from .linear_kernels import QuantKernel


class PagedAttention(CodePaths):
    """ctypes binding of paged_attention.c. `isa` is the code path it runs: the fastest this CPU has
    (paged_best_path) unless one is named; PATHS lists them all, `supported()` those this CPU runs."""

    PATHS = {"portable": 1, "avx2": 2, "avx512": 3}

    def __init__(self, path: Path, isa: str | None = None):
        self.path = path
        self.lib = lib = ctypes.CDLL(str(path))
        self._path_supported = bind_function(lib, "paged_path_supported", [ctypes.c_int])
        lib.paged_best_path.restype = ctypes.c_int
        self._decode = lib.paged_decode_window_path
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._decode.argtypes = [ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64,
                                 i64, i64, ctypes.c_float, i64, i64, i64]
        self._decode.restype = ctypes.c_int
        if isa is None:
            isa = next(name for name, code in self.PATHS.items() if code == lib.paged_best_path())
        if not self.supports(isa):
            raise ValueError(f"paged attention path {isa!r} is not available on this CPU (supported: "
                             f"{', '.join(self.supported())})")
        self.isa = isa
        self.code = self.PATHS[isa]

    def decode(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               tables: torch.Tensor, lens: torch.Tensor, begin: int, end: int, block_size: int,
               scale: float, kv_heads: tuple[int, int] | None = None, window: int = 0) -> None:
        """Attention of float32 decode queries q [B, H, E] over their cached context into out [B, H, E] (rows
        begin..end-1 only; with `kv_heads` (first, end), only those kv heads' query heads). k_cache, v_cache:
        [slots, K, E] of one layer, float32 or float16 (the 16-bit KV cache); tables [B, NB], lens [B] int64.
        `window` > 0: only the last `window` keys of each context (a sliding-window layer). Releases the GIL while it
        runs (ctypes does), so two threads can split one batch."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        first, last = kv_heads or (0, k_cache.shape[1])
        rc = self._decode(self.code, k_cache.dtype == torch.float16, q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          tables.data_ptr(), tables.shape[1], lens.data_ptr(), begin, end, num_heads,
                          k_cache.shape[1], head_dim, block_size, scale, first, last, window)
        if rc != 0:
            raise RuntimeError(f"paged_decode_window_path ({self.isa}) failed (code {rc})")


class LayerOps:
    """ctypes binding of layer_ops.c: RMSNorm (+ residual), rotary embedding + K/V cache write, SiLU or GeLU * up, the
    q/k heads' RMSNorm."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._norm = lib.add_rms_norm_f32
        self._norm.argtypes = [ptr, ptr, ptr, f32, ptr, i64, i64]
        self._norm.restype = None
        self._rope = lib.rope_store_kv
        self._rope.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
        self._rope.restype = ctypes.c_int
        self._silu = lib.silu_mul_f32
        self._silu.argtypes = [ptr, ptr, i64, i64]
        self._silu.restype = None
        self._gelu = lib.gelu_mul_f32
        self._gelu.argtypes = [ptr, ptr, i64, i64]
        self._gelu.restype = None
        self._norm_heads = lib.rms_norm_heads_f32
        self._norm_heads.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, f32]
        self._norm_heads.restype = None
        self._step = lib.decode_step_f32
        self._step.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr]
        self._step.restype = ctypes.c_int
        set_spin_us(lib)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, D] += delta (in place, when given); out [T, D] = RMSNorm(h) * weight (a new tensor when out is
        None), returned. All float32, contiguous."""
        out = torch.empty_like(h) if out is None else out
        self._norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
                   h.shape[0], h.shape[1])
        return out

    def rope_store(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, q_out: torch.Tensor | None = None) -> None:
        """Rotate the query and key heads of qkv [T, (H+2K)*E] (rows contiguous) in place; write K and V to the
        caches [S, K, E] (float32, or float16: rounded to nearest) at `slots` [T] int64, and the rotated queries to
        q_out [T, H*E] (contiguous) when given.
        cos, sin: [max_context, E] tables; positions [T] int64."""
        rc = self._rope(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, head_dim,
                        cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                        v_cache.data_ptr(), None if q_out is None else q_out.data_ptr(), k_cache.dtype == torch.float16)
        if rc != 0:
            raise RuntimeError(f"rope_store_kv failed (code {rc})")

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:] (a new tensor when out is None), returned; gate_up
        [T, 2I] contiguous."""
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2) if out is None else out
        self._silu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], out.shape[1])
        return out

    def gelu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, I] = gelu(gate_up[:, :I], tanh approximation) * gate_up[:, I:] (GeGLU), as silu_mul."""
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2) if out is None else out
        self._gelu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], out.shape[1])
        return out

    def rms_norm_heads(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> None:
        """Each query head of qkv [T, (H+2K)*E] (rows `stride(0)` apart) RMS-normalized in place with q_weight [E],
        each key head with k_weight [E]; the value heads left alone."""
        self._norm_heads(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, head_dim,
                         q_weight.data_ptr(), k_weight.data_ptr(), eps)

    def decode_plan(self, layers: list, k_cache: torch.Tensor, v_cache: torch.Tensor, shape: PlanShape,
                    int4_operands=None) -> DecodePlan | None:
        """The plan of `decode_step` for a model's layers (model.LayerWeights), or None when a layer's weights are
        not all int8 / int4 (quant.QWeight / Q4Weight): float weights keep the per-operation path.
        `int4_operands(w)`: the (q, sm) tensors the int4 products read, when the route's path multiplies another
        layout than w.q (the x22 paths: Int4Linear.packed); w's own by default."""
        return DecodePlan.build(layers, k_cache, v_cache, shape, int4_operands)

    def decode_step(self, plan: DecodePlan, step: StepKernels, h: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, groups: list) -> None:
        """Every layer of a step in one call (layer_ops.c, decode_step_f32): h [T, D] (the embeddings) is
        updated in place to the last layer's output, the K/V of the step's tokens written to the caches. positions,
        slots [T] int64; groups: model.AttentionGroup with max_q 1 and lens (int64, contiguous tables)."""
        num_tokens = h.shape[0]
        descs = (_DGroup * len(groups))(*[
            _DGroup(g.kv_blocks.data_ptr(), g.kv_blocks.shape[1], g.lens.data_ptr(), g.out_start, g.num_seqs, g.split)
            for g in groups])
        scratch = plan.scratch(num_tokens)
        rc = self._step(ctypes.byref(plan.model), ctypes.byref(step.desc), h.data_ptr(), num_tokens,
                        positions.data_ptr(), slots.data_ptr(), descs, len(groups), scratch.data_ptr(), plan.where)
        if rc != 0:
            layer, stage = plan.where[0], plan.where[1]
            raise RuntimeError(f"decode_step_f32 failed in layer {layer} at "
                               f"{DecodePlan.STAGES.get(stage, stage)} (code {rc})")


class _DWeight(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("q", ctypes.c_void_p), ("s", ctypes.c_void_p), ("N", ctypes.c_int64),
                ("K", ctypes.c_int64), ("G", ctypes.c_int64)]


class _DLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", _DWeight), ("o", _DWeight), ("gate_up", _DWeight), ("down", _DWeight),
                *((name, ctypes.c_void_p) for name in ("k_cache", "v_cache", "q_norm", "k_norm", "post_attn_norm",
                                                       "post_ff_norm", "cos", "sin")),
                ("window", ctypes.c_int64)]


class _DModel(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in ("num_layers", "D", "H", "KV", "E", "I", "block_size")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("layers", ctypes.POINTER(_DLayer)),
                ("kv16", ctypes.c_int64), ("gelu", ctypes.c_int64)]


class _DKernels(ctypes.Structure):
    _fields_ = [("linear", ctypes.c_void_p * 2), ("linear2", ctypes.c_void_p * 2), ("path", ctypes.c_int64 * 2),
                ("split", ctypes.c_int64), ("paged", ctypes.c_void_p), ("paged_path", ctypes.c_int64),
                ("split_attention", ctypes.c_int64)]


class _DGroup(ctypes.Structure):
    _fields_ = [("tables", ctypes.c_void_p), ("max_blocks", ctypes.c_int64), ("lens", ctypes.c_void_p),
                ("out_start", ctypes.c_int64), ("num_seqs", ctypes.c_int64), ("split", ctypes.c_int64)]


class StepKernels:
    """What one fused decode step multiplies and attends with: the int8 / int4 libraries' product entry points (the
    C functions QuantRoute.product calls, by address) on the route's code paths, whether products split over two
    threads, and the paged-attention entry point and path. Built once per (route, split) and kept."""

    KINDS = {"QWeight": 0, "Q4Weight": 1}

    def __init__(self, int8: QuantKernel | None, int4: QuantKernel | None, split: bool, paged: PagedAttention,
                 split_attention: bool):
        self.desc = desc = _DKernels()
        for kind, kernel in enumerate((int8, int4)):
            if kernel is not None:
                prefix = kernel.PREFIX
                desc.linear[kind] = address(kernel.lib, f"{prefix}_linear_f32")
                desc.linear2[kind] = address(kernel.lib, f"{prefix}_linear_f32_2t")
                desc.path[kind] = kernel.code
        desc.split, desc.split_attention = int(split), int(split_attention)
        desc.paged, desc.paged_path = address(paged.lib, "paged_decode_window_path"), paged.code
        self.plan: DecodePlan | None = None  # the plan over the weight layout these paths read (model.py sets it)


@dataclass(frozen=True)
class PlanShape:
    """What decode_step_f32 needs of a model besides its layers' weights and KV cache."""

    ropes: list  # per layer, its rotary tables (cos, sin) [max_context, E]: Gemma 3's local layers have their own
    windows: list[int]  # per layer, its sliding window (model.layer_windows; 0: every key)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float  # the attention's
    block_size: int
    gelu: bool = False  # the MLP's activation is GeLU's tanh approximation (Gemma 3's GeGLU), not SiLU


class DecodePlan:
    """The per-weight pointers of decode_step_f32, built once at model load (the tensors are kept alive here), and
    its scratch buffer, grown to the largest step seen and reused."""

    STAGES = {1: "qkv", 2: "rope_store", 3: "attention", 4: "o", 5: "gate_up", 6: "down", 7: "arguments"}

    def __init__(self, model: _DModel, layers, keep: list, kinds: set[int], per_token: int):
        self.model, self._layers, self.kept, self.kinds, self._per_token = model, layers, keep, kinds, per_token
        self.where = (ctypes.c_int64 * 2)()
        self._scratch = torch.empty(0)

    @classmethod
    def build(cls, layers: list, k_cache: torch.Tensor, v_cache: torch.Tensor, shape: PlanShape,
              int4_operands=None) -> DecodePlan | None:
        ropes = [t for pair in shape.ropes for t in pair]
        keep: list = [k_cache, v_cache, *ropes]
        kinds: set[int] = set()

        def weight(w) -> _DWeight | None:
            kind = StepKernels.KINDS.get(type(w).__name__)
            if kind is None:
                return None
            kinds.add(kind)
            q, s = (w.q, w.scale) if kind == 0 else int4_operands(w) if int4_operands else (w.q, w.sm)
            keep.extend((q, s))
            return _DWeight(kind, q.data_ptr(), s.data_ptr(), w.num_out, w.shape[1], w.group_size)

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        norms = [[w.input_norm, w.post_norm, w.qkv_bias, w.q_norm, w.k_norm, w.post_attn_norm, w.post_ff_norm]
                 for w in layers]
        tensors = ropes + [t for ts in norms for t in ts if t is not None]
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors) or v_cache.dtype != k_cache.dtype \
                or k_cache.dtype not in (torch.float32, torch.float16) or not (k_cache.is_contiguous()
                                                                               and v_cache.is_contiguous()) \
                or any((w.q_norm is None) != (w.k_norm is None) for w in layers):
            return None
        descs = (_DLayer * len(layers))()
        for i, (w, (cos, sin)) in enumerate(zip(layers, shape.ropes, strict=True)):
            products = [weight(p) for p in (w.qkv, w.o, w.gate_up, w.down)]
            if any(p is None for p in products):
                return None
            descs[i] = _DLayer(ptr(w.input_norm), ptr(w.post_norm), ptr(w.qkv_bias), *products, k_cache[i].data_ptr(),
                               v_cache[i].data_ptr(), *(ptr(t) for t in norms[i][3:]), ptr(cos), ptr(sin),
                               shape.windows[i])
            keep.extend(t for t in norms[i] if t is not None)
        first = layers[0]
        dim, inter = first.o.num_out, first.down.shape[1]
        heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        qkv_size, q_size = (heads + 2 * kv_heads) * head_dim, heads * head_dim
        shapes = {(qkv_size, dim), (dim, q_size), (2 * inter, dim), (dim, inter)}
        if any({tuple(p.shape) for p in (w.qkv, w.o, w.gate_up, w.down)} != shapes for w in layers):
            return None
        model = _DModel(len(layers), dim, heads, kv_heads, head_dim, inter, shape.block_size, shape.eps, shape.scale,
                        descs, k_cache.dtype == torch.float16, shape.gelu)
        per_token = 3 * dim + qkv_size + 2 * q_size + 3 * inter
        return cls(model, descs, keep, kinds, per_token)

    def scratch(self, num_tokens: int) -> torch.Tensor:
        """At least num_tokens * per-token floats (decode_step_f32's x, qkv, q, attn, o, gate_up, act, down)."""
        need = num_tokens * self._per_token
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        return self._scratch
