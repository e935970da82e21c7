"""engine/hugepages.py: the arena places tensors bit for bit on page boundaries of a 2 MiB-aligned region, the kernel
really backs it with huge pages where THP is `madvise` or `always`, and TOKENLOOP_HUGE_PAGES=off / THP `never` leave
torch's tensors as they are."""

from __future__ import annotations

import pytest
import torch

from tokenloop.engine import hugepages
from tokenloop.engine.quant import qweight, qweight4


def needs_thp():
    reason = hugepages.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no huge pages here: {reason}")


@pytest.fixture(autouse=True)
def huge_pages_on(monkeypatch):
    monkeypatch.delenv(hugepages.ENV, raising=False)


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(path) == "madvise"
    path.write_text("[always] madvise never\n")
    assert hugepages.thp_mode(path) == "always"
    assert hugepages.thp_mode(tmp_path / "missing") is None


def test_arena_places_aligned_copies_with_the_same_bits():
    needs_thp()
    arena = hugepages.Arena(6 << 20)
    assert arena.buffer.data_ptr() % hugepages.HUGE_PAGE == 0 and arena.size == 6 << 20
    sources = [torch.randn(7, 13), torch.randint(0, 255, (1000,), dtype=torch.uint8), torch.randn(3, 5).half(),
               torch.randn(64, 33, dtype=torch.float64)[:, :32]]  # the last one not contiguous
    placed = [arena.place(t) for t in sources]
    for src, out in zip(sources, placed):
        assert out.dtype == src.dtype and out.shape == src.shape and out.is_contiguous()
        assert torch.equal(out, src) and out.data_ptr() % hugepages.PAGE == 0
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in placed]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends, placed[1:]))  # no overlap
    with pytest.raises(ValueError, match="arena of 6291456 bytes is full"):
        arena.empty((7 << 20,), torch.uint8)


def test_arena_and_zeros_are_on_huge_pages():
    needs_thp()
    arena = hugepages.Arena(8 << 20)
    arena.place(torch.ones(8 << 20, dtype=torch.uint8))
    assert hugepages.huge_bytes(arena.buffer) > 0, "the kernel gave the madvised arena no huge page"
    cache = hugepages.zeros((4, 1024, 2, 128), torch.float32)  # 4 MiB
    assert cache.abs().sum() == 0 and cache.shape == (4, 1024, 2, 128)  # zeros without being written
    cache[:, :, :, :] = 1.0  # its pages fault in as they are written, huge
    assert hugepages.huge_bytes(cache) > 0


def test_huge_bytes_is_zero_for_an_unknown_pointer(tmp_path):
    assert hugepages.huge_bytes(torch.ones(4), tmp_path / "no-smaps") == 0


def test_move_weights_moves_every_tensor_but_the_embedding_and_keeps_ties():
    needs_thp()
    embed = torch.randn(96, 64)
    weights = {"embed": embed, "norm": torch.randn(64), "lm_head": embed, "layers.0.qkv": qweight(torch.randn(96, 64)),
               "layers.0.o": qweight4(torch.randn(64, 64)), "layers.0.input_norm": torch.randn(64)}
    moved = hugepages.move_weights(dict(weights))
    assert moved["embed"] is moved["lm_head"] and moved["embed"] is not embed  # tied: placed once, still shared
    assert torch.equal(moved["embed"], embed)
    storage = moved["norm"].untyped_storage().data_ptr()
    for name in ("norm", "lm_head", "layers.0.input_norm"):
        assert moved[name].untyped_storage().data_ptr() == storage and torch.equal(moved[name], weights[name])
    for name, fields in (("layers.0.qkv", ("q", "scale")), ("layers.0.o", ("q", "sm"))):
        assert type(moved[name]) is type(weights[name]) and moved[name].num_out == weights[name].num_out
        for f in fields:
            t = getattr(moved[name], f)
            assert t.untyped_storage().data_ptr() == storage and torch.equal(t, getattr(weights[name], f))
    in_place = dict(weights)
    assert hugepages.move_weights(in_place) is in_place and in_place["norm"] is not weights["norm"]
    untied = hugepages.move_weights({**weights, "lm_head": torch.randn(96, 64)})
    assert untied["embed"] is embed  # read a few rows a step: left where it is


@pytest.mark.parametrize("mode", ["off", "OFF", "0"])
def test_off_leaves_torch_tensors(monkeypatch, mode):
    monkeypatch.setenv(hugepages.ENV, mode)
    assert hugepages.unavailable_reason() == "TOKENLOOP_HUGE_PAGES=off"
    weights = {"embed": torch.randn(4, 4), "norm": torch.randn(4)}
    assert hugepages.move_weights(weights) is weights
    # no Arena is made (huge_bytes would not tell: under THP `always` torch's own heap may be huge-backed)
    monkeypatch.setattr(hugepages, "Arena", lambda size: pytest.fail(f"an Arena of {size} bytes was made"))
    z = hugepages.zeros((1024, 1024), torch.float32)
    assert z.shape == (1024, 1024) and not z.any()


def test_thp_never_leaves_torch_tensors(monkeypatch, tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "THP_ENABLED", path)
    assert "never" in hugepages.unavailable_reason()
    weights = {"norm": torch.randn(4)}
    assert hugepages.move_weights(weights) is weights
    monkeypatch.setattr(hugepages, "THP_ENABLED", tmp_path / "missing")
    assert "missing" in hugepages.unavailable_reason()
