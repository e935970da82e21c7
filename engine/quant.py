"""int8 weights (`--weights int8`): symmetric per-output-channel quantization at load time, and the product.

A float weight [N, K] becomes int8 values q [N, K] and one float32 scale per output channel s [N], with
s[n] = max_k |w[n, k]| / 127 and q = round(w / s): w ~ s[:, None] * q, zero maps to zero. Activations and
accumulation stay float32. The product runs in the native kernel (int8_linear.c) split over two threads
where it builds, else in torch (`(x @ q.float().T) * s`: slower, the same figures up to float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_MODES = ("fp32", "int8")


@dataclass(frozen=True, slots=True)
class QWeight:
    """An int8 weight: q [N, K] int8 and scale [N] float32 (w ~ scale[:, None] * q)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8, scale [N] float32), symmetric, one scale per row."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def qweight(w: torch.Tensor) -> QWeight:
    return QWeight(*quantize_per_channel(w))
