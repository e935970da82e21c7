"""The decoder layer's small operations in torch, with the interface of their C versions (kernels.LayerOps,
layer_ops.c): the model's one layer loop runs on either. This one serves models without the native operations
(bfloat16 / float16 activations, or no C compiler)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, as transformers computes it (so outputs match bit for bit)."""
    if x.dtype != torch.bfloat16:  # the fused kernel gives the same bits in float32 and float64
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout. x: [T, heads, E]; cos, sin: [T, 1, E]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchLayerOps:
    """kernels.LayerOps in torch. The norms return new tensors (`out` is the C version's destination, unused here)."""

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, D] += delta (in place, when given); returns RMSNorm(h) * weight."""
        if delta is not None:
            h.add_(delta)
        return rms_norm(h, weight, eps)

    def rope_store(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, q_out: torch.Tensor | None = None) -> None:
        """Rotate the query and key heads of qkv [T, (H+2K)*E] in place; write K and V to the caches [S, K, E] at
        `slots` [T], and the rotated queries to q_out [T, H, E] when given. cos, sin: [max_context, E] tables."""
        num_tokens, qk_size = qkv.shape[0], (num_heads + num_kv_heads) * head_dim
        qk = qkv[:, :qk_size].view(num_tokens, num_heads + num_kv_heads, head_dim)  # [T, H+K, E]
        qk.copy_(rotate(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)))
        k_cache.index_copy_(0, slots, qk[:, num_heads:].to(k_cache.dtype))  # rounded to a 16-bit cache's dtype
        v_cache.index_copy_(0, slots, qkv[:, qk_size:].view(num_tokens, num_kv_heads, head_dim).to(v_cache.dtype))
        if q_out is not None:
            q_out.copy_(qk[:, :num_heads])

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate_up[:, :I]) * gate_up[:, I:], contiguous [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) * up).contiguous()

    def gelu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """gelu(gate_up[:, :I], tanh approximation) * gate_up[:, I:] (GeGLU), contiguous [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") * up).contiguous()

    def rms_norm_heads(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> None:
        """Each query head of qkv [T, (H+2K)*E] RMS-normalized in place with q_weight [E], each key head with
        k_weight [E]."""
        qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(qkv.shape[0], -1, head_dim)  # [T, H+K, E]
        qk[:, :num_heads] = rms_norm(qk[:, :num_heads], q_weight, eps)
        qk[:, num_heads:] = rms_norm(qk[:, num_heads:], k_weight, eps)
