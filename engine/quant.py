"""int8 weights (`--weights int8`): symmetric int8 quantization at load time, one scale per output channel and
group of 32 input columns.

A float weight [N, K] becomes int8 values q and float32 scales s: for each output channel n and group g of G
consecutive input columns, s[n, g] = max |w[n, g*G : (g+1)*G]| / 127 and q = round(w / s), so w ~ s * q and zero
maps to zero. G = 32 is llama.cpp's Q8_0 block; G = K is one scale per channel (docs/engine.md: per channel alone
changes greedy output on 6 of 16 chat prompts, groups of 32 on 3). Activations and accumulation stay float32.

Both are stored packed 32 output channels at a time, the layout the native kernel (int8_linear.c) reads:
q [ceil(N/32), K, 32], scale [ceil(N/32), K/G, 32] (channels past N are zero); a block's columns are contiguous, so
a one-row product reads its weights as sequential streams. Without the kernel, torch multiplies by
the weight widened back to float.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_MODES = ("fp32", "int8")
GROUP_SIZE = 32
PACK = 32  # output channels interleaved per column


@dataclass(frozen=True, slots=True)
class QWeight:
    """An int8 weight of `num_out` x K: packed q [N32, K, 32] int8 and scale [N32, K // group_size, 32] float32."""

    q: torch.Tensor
    scale: torch.Tensor
    group_size: int
    num_out: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_out, self.q.shape[1]))

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K] int8, scale [N, K // group_size] float32), one row per output channel."""
        nb, k, _ = self.q.shape
        q = self.q.permute(0, 2, 1).reshape(nb * PACK, k)[:self.num_out]
        return q, self.scale.permute(0, 2, 1).reshape(nb * PACK, -1)[:self.num_out]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the int8 values stand for (what the kernel multiplies by)."""
        nb, k, _ = self.q.shape
        q = self.q.permute(0, 2, 1).reshape(nb * PACK, k // self.group_size, self.group_size).float()
        s = self.scale.permute(0, 2, 1).reshape(nb * PACK, -1, 1)
        return (q * s).reshape(nb * PACK, k)[:self.num_out].contiguous()


def group_size_for(num_in: int, group_size: int = GROUP_SIZE) -> int:
    """Groups of `group_size` columns where they divide the row evenly, else one group per row."""
    return group_size if num_in % group_size == 0 else num_in


def quantize(w: torch.Tensor, group_size: int = GROUP_SIZE) -> QWeight:
    """w [N, K] float -> QWeight, symmetric, one scale per output channel and group of columns."""
    n, k = w.shape
    g = group_size_for(k, group_size)
    nb = -(-n // PACK)
    padded = torch.zeros(nb * PACK, k, dtype=torch.float32)
    padded[:n] = w.float()
    groups = padded.view(nb * PACK, k // g, g)
    amax = groups.abs().amax(dim=-1)  # [NB*32, K / g]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(groups / scale[:, :, None]).clamp_(-127, 127).to(torch.int8).view(nb, PACK, k)
    return QWeight(q.permute(0, 2, 1).contiguous(), scale.view(nb, PACK, -1).permute(0, 2, 1).contiguous(), g, n)


def qweight(w: torch.Tensor) -> QWeight:
    return quantize(w)
