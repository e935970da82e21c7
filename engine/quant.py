"""int8 weights (`--weights int8`) and 4-bit weights (`--weights int4`, Q4Weight below): symmetric int8 quantization at load time, one scale per output channel and
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

import dataclasses
from dataclasses import dataclass

import torch

WEIGHT_MODES = ("fp32", "int8", "int4")
WEIGHT_CHOICES = (*WEIGHT_MODES, "auto")  # auto: a GGUF file's own precision (engine/gguf.py), else fp32
GROUP_SIZE = 32
PACK = 32  # output channels interleaved per column


class _Packed:
    """What QWeight and Q4Weight share: `q` packed [N32, K, ...] and `num_out` channels of them are real (a
    Q4Weight may hold the vnni packing instead, [N32, K/4, 16, 4]: Q4Weight.repack_vnni)."""

    __slots__ = ()

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_out, self.q.shape[1] * (self.q.shape[3] if self.q.dim() == 4 else 1)))


def pack_vnni(q: torch.Tensor, lanes: int, group_size: int) -> torch.Tensor:
    """[N32, K, lanes] bytes (a block's channels at each column) -> [N32, K/4, lanes, 4]: four columns of a channel
    in one 32-bit lane, what vpdpbusd multiplies (int8_linear.c / int4_linear.c, path vnni)."""
    nb, k, _ = q.shape
    if group_size % 4:
        raise ValueError(f"the vnni path needs groups of a multiple of 4 columns, not {group_size}")
    return q.view(nb, k // 4, 4, lanes).permute(0, 1, 3, 2).contiguous()


@dataclass(frozen=True, slots=True)
class QWeight(_Packed):
    """An int8 weight of `num_out` x K: packed q [N32, K, 32] int8 and scale [N32, K // group_size, 32] float32.
    `head`: the model's lm_head, which a route may multiply on its own path (quant_routes.QuantRoute.head)."""

    q: torch.Tensor
    scale: torch.Tensor
    group_size: int
    num_out: int
    head: bool = False

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


def _groups(w: torch.Tensor, group_size: int) -> tuple[int, int, int, int, torch.Tensor]:
    """(N, K, G, N32, w as float32 [N32 * 32, K / G, G], the channels past N zero)."""
    n, k = w.shape
    g = group_size_for(k, group_size)
    nb = -(-n // PACK)
    padded = torch.zeros(nb * PACK, k, dtype=torch.float32)
    padded[:n] = w.float()
    return n, k, g, nb, padded.view(nb * PACK, k // g, g)


def quantize(w: torch.Tensor, group_size: int = GROUP_SIZE) -> QWeight:
    """w [N, K] float -> QWeight, symmetric, one scale per output channel and group of columns."""
    n, k, g, nb, groups = _groups(w, group_size)
    amax = groups.abs().amax(dim=-1)  # [NB*32, K / g]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(groups / scale[:, :, None]).clamp_(-127, 127).to(torch.int8).view(nb, PACK, k)
    return QWeight(q.permute(0, 2, 1).contiguous(), scale.view(nb, PACK, -1).permute(0, 2, 1).contiguous(), g, n)


def _pad_rows(x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(N32, x [N, ...] with zero rows appended up to a multiple of 32)."""
    n = x.shape[0]
    nb = -(-n // PACK)
    if nb * PACK == n:
        return nb, x
    return nb, torch.cat([x, x.new_zeros((nb * PACK - n, *x.shape[1:]))])


def pack8(q: torch.Tensor, scale: torch.Tensor) -> QWeight:
    """QWeight from values already quantized: q [N, K] int8 and scale [N, K // G] float32 (w = scale * q per group
    of G columns), e.g. llama.cpp's Q8_0 blocks (engine/gguf.py): the same numbers, in the kernel's layout."""
    n, k = q.shape
    g = k // scale.shape[1]
    nb, qp = _pad_rows(q)
    _, sp = _pad_rows(scale.float())
    return QWeight(qp.view(nb, PACK, k).permute(0, 2, 1).contiguous(),
                   sp.view(nb, PACK, -1).permute(0, 2, 1).contiguous(), g, n)


def qweight(w: torch.Tensor) -> QWeight:
    return quantize(w)


def embedding_rows(embed: torch.Tensor | QWeight, ids: torch.Tensor) -> torch.Tensor:
    """The rows of `ids` [T] of an embedding table [V, D]: a float tensor's own rows (a new tensor), or a QWeight's
    dequantized (a GGUF file's tied Q8_0 token_embd, which serves as the int8 lm_head too: q * scale per group in
    float32, the same values the file's dequantized table holds, without a float32 copy of the table)."""
    if isinstance(embed, torch.Tensor):
        return embed[ids]
    blocks, lanes = ids // PACK, ids % PACK
    q, scale = embed.q[blocks, :, lanes], embed.scale[blocks, :, lanes]  # [T, K], [T, K / G]
    return (q.float().view(len(ids), -1, embed.group_size) * scale[:, :, None]).view(len(ids), -1)


def as_head(w: QWeight) -> QWeight:
    """w marked as the model's lm_head (QWeight.head)."""
    return dataclasses.replace(w, head=True)


@dataclass(frozen=True, slots=True)
class Q4Weight(_Packed):
    """A 4-bit weight of `num_out` x K (`--weights int4`), llama.cpp's Q4_1 block: for output channel n and group g of
    `group_size` columns, w ~ d[n, g] * q + m[n, g] with q in 0..15, d = (max - min) / 15 and m = min over the group
    (`symmetric`: Q4_0-like, d = max|w| / -8 signed as llama.cpp does and m = -8 d, so zero is exact).

    Packed for engine/int4_linear.c, 32 output channels per block as QWeight: q [N32, K, 16] uint8, byte j of a
    block's column holding channel j in its low nibble and channel 16 + j in its high one; sm [N32, K // group_size,
    2, 32] float16, the scales (sm[:, :, 0]) and minimums (sm[:, :, 1]) of the block's 32 channels. 0.625 bytes per
    weight (llama.cpp's Q4_1: 20 bytes per 32 weights)."""

    q: torch.Tensor
    sm: torch.Tensor
    group_size: int
    num_out: int

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K] uint8 in 0..15, d [N, K // group_size] float32, m [N, K // group_size] float32)."""
        plain = self.plain_q()
        nb, k, _ = plain.shape
        q = torch.cat([plain & 15, plain >> 4], dim=2)  # [N32, K, 32]: channels 0..15, then 16..31
        q = q.permute(0, 2, 1).reshape(nb * PACK, k)[:self.num_out]
        sm = self.sm.float().permute(0, 3, 1, 2).reshape(nb * PACK, -1, 2)[:self.num_out]
        return q, sm[:, :, 0].contiguous(), sm[:, :, 1].contiguous()

    def plain_q(self) -> torch.Tensor:
        """q in the block layout [N32, K, 16]: q itself, or a copy unpacked from the vnni packing (repack_vnni)."""
        if self.q.dim() == 3:
            return self.q
        nb, k4, lanes, four = self.q.shape
        return self.q.permute(0, 1, 3, 2).reshape(nb, k4 * four, lanes)

    def repack_vnni(self) -> torch.Tensor:
        """Turn q, in place, into the vnni packing [N32, K/4, 16, 4] that the x22 paths multiply (four columns of a
        channel in one 32-bit lane) and return it: the same bytes reordered in q's own storage (the weights' huge-page
        arena), through one weight's temporary copy, so that x22 serving keeps one copy of the 4-bit weights, not
        two. Idempotent."""
        if self.q.dim() == 4:
            return self.q
        packed = pack_vnni(self.q, self.q.shape[2], self.group_size)
        self.q.view(-1).copy_(packed.view(-1))
        object.__setattr__(self, "q", self.q.view(-1).view(packed.shape))
        return self.q

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the 4-bit values stand for (what the kernel multiplies by)."""
        q, d, m = self.unpacked()
        n, k = q.shape
        w = q.float().view(n, -1, self.group_size) * d[:, :, None] + m[:, :, None]
        return w.view(n, k).contiguous()


def quantize4(w: torch.Tensor, group_size: int = GROUP_SIZE, symmetric: bool = False) -> Q4Weight:
    """w [N, K] float -> Q4Weight: per output channel and group of columns, Q4_1-like (scale and minimum) or, with
    `symmetric`, Q4_0-like (a scale alone). The levels are computed from the float16 scale and minimum as stored,
    so a weight already on a Q4_1 grid (the default checkpoint is a dequantized Q4_1 GGUF) comes back exactly."""
    n, k, g, nb, groups = _groups(w, group_size)
    if symmetric:  # llama.cpp's Q4_0: the value of largest magnitude maps to -8 exactly
        idx = groups.abs().argmax(dim=-1, keepdim=True)
        d = (groups.gather(-1, idx).squeeze(-1) / -8.0).half()
        m = (d.float() * -8.0).half()
    else:
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        d, m = ((hi - lo) / 15.0).half(), lo.half()
    df, mf = d.float()[:, :, None], m.float()[:, :, None]
    inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round((groups - mf) * inv).clamp_(0, 15).to(torch.uint8).view(nb * PACK, k)
    return pack4(q, d, m, n)


def pack4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, num_out: int | None = None) -> Q4Weight:
    """Q4Weight from values already quantized: q [N, K] uint8 in 0..15, d and m [N, K // G] float16 (w = d * q + m per
    group of G columns), e.g. llama.cpp's Q4_0 / Q4_1 blocks (engine/gguf.py): the same numbers, in the kernel's
    layout. Rows past `num_out` (default N) are padding."""
    n, k = q.shape
    g = k // d.shape[1]
    nb, q = _pad_rows(q)
    _, d = _pad_rows(d.half())
    _, m = _pad_rows(m.half())
    q = q.view(nb, PACK, k).permute(0, 2, 1)  # [N32, K, 32]
    packed = (q[:, :, :PACK // 2] | (q[:, :, PACK // 2:] << 4)).contiguous()
    sm = torch.stack([d, m], dim=-1).view(nb, PACK, k // g, 2).permute(0, 2, 3, 1).contiguous()
    return Q4Weight(packed, sm, g, n if num_out is None else num_out)


def qweight4(w: torch.Tensor) -> Q4Weight:
    return quantize4(w)
