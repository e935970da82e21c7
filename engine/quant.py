"""int8 weights (`--weights int8`): symmetric int8 quantization at load time, one scale per output channel and
group of 32 input columns.

A float weight [N, K] becomes int8 values q [N, K] and float32 scales s [N, K / G]: for each output channel n
and group g of G consecutive input columns, s[n, g] = max |w[n, g*G : (g+1)*G]| / 127 and q = round(w / s), so
w ~ s * q and zero maps to zero. G = 32 is llama.cpp's Q8_0 block; G = K is one scale per channel (measured in
docs/engine.md: per channel alone keeps perplexity within 0.2 % but changes greedy output on 6 of 16 chat
prompts, groups of 32 on 3). Activations and accumulation stay float32. The product runs in the native kernel
(int8_linear.c) where it builds, else in torch on the weight widened back to float.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_MODES = ("fp32", "int8")
GROUP_SIZE = 32


@dataclass(frozen=True, slots=True)
class QWeight:
    """An int8 weight: q [N, K] int8 and scale [N, K // group_size] float32 (w ~ scale * q, group by group)."""

    q: torch.Tensor
    scale: torch.Tensor
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the int8 values stand for (what the kernel multiplies by)."""
        n, k = self.q.shape
        groups = self.q.view(n, k // self.group_size, self.group_size).float()
        return (groups * self.scale[:, :, None]).view(n, k)


def group_size_for(num_in: int, group_size: int = GROUP_SIZE) -> int:
    """Groups of `group_size` columns where they divide the row evenly, else one group per row."""
    return group_size if num_in % group_size == 0 else num_in


def quantize(w: torch.Tensor, group_size: int = GROUP_SIZE) -> QWeight:
    """w [N, K] float -> QWeight, symmetric, one scale per output channel and group of columns."""
    n, k = w.shape
    g = group_size_for(k, group_size)
    groups = w.float().view(n, k // g, g)
    amax = groups.abs().amax(dim=-1)  # [N, K / g]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(groups / scale[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return QWeight(q.view(n, k).contiguous(), scale.contiguous(), g)


def qweight(w: torch.Tensor) -> QWeight:
    return quantize(w)
