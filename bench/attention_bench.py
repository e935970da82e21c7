"""Decode attention (engine/paged_attention.c) on the default model's shapes: kernels interleaved in one run.

    flock /tmp/bench.lock .venv/bin/tokenloop-bench attention [--base main] [--batch 32] [--lens 64,128,192]

One decode step's attention over all layers, each layer its own paged K/V cache (so the step streams the cache
from memory as the engine's does: 32 sequences x 128 tokens x 30 layers is ~190 MB of fp32 K and V), every
sequence's blocks scattered over the cache in a shuffled order. Candidates:

  base-ISA   paged_attention.c as committed on `--base` (a git revision), built from `git show`
  new-ISA    the working tree's paged_attention.c
  ... 1t     the whole batch on this thread;  2t: halved over two threads, as the engine runs it (split_attention)

Rounds interleave the candidates (so a burst of load from elsewhere cannot land on one candidate only); the figure
is the best round's ms per step (all layers), and the ratio to the base's same-ISA figure. Each candidate's output
is also checked against the base's (max abs difference) and for batch invariance (a sequence alone == in the batch).
`stream Nt`: torch.sum over the same caches on N threads, what this machine streams from memory at that moment:
the floor for a kernel that must read them all.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import torch

from tokenloop.bench.harness import ROOT, machine
from tokenloop.engine import kernels


class Pair:
    """A second thread that runs one job per call, so a batch can be halved as the engine's helper thread does."""

    def __init__(self):
        self._go, self._done, self._job = threading.Semaphore(0), threading.Semaphore(0), None
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            self._go.acquire()
            self._job()
            self._done.release()

    def split(self, mine, theirs):
        self._job = theirs
        self._go.release()
        mine()
        self._done.acquire()


def setup(batch: int, length: int, layers: int, heads: int, kv_heads: int, head_dim: int, block_size: int):
    gen = torch.Generator().manual_seed(length)
    nb = (length + block_size - 1) // block_size
    num_blocks = batch * nb + 8
    caches = [(torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen),
               torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)) for _ in range(layers)]
    tables = torch.randperm(num_blocks, generator=gen)[:batch * nb].view(batch, nb).contiguous()
    lens = torch.full((batch,), length, dtype=torch.long)
    q = torch.randn(layers, batch, heads, head_dim, generator=gen)
    return caches, tables, lens, q


def step(kernel, pair, data, block_size, scale, threads):
    caches, tables, lens, q = data
    out = torch.empty_like(q[0])
    batch = q.shape[1]
    for i, (kc, vc) in enumerate(caches):
        if threads == 1:
            kernel.decode(q[i], out, kc, vc, tables, lens, 0, batch, block_size, scale)
        else:
            run = partial(kernel.decode, q[i], out, kc, vc, tables, lens)
            pair.split(partial(run, 0, batch // 2, block_size, scale), partial(run, batch // 2, batch, block_size, scale))
    return out


def base_kernel(rev: str) -> kernels.PagedAttention:
    text = subprocess.run(["git", "show", f"{rev}:engine/paged_attention.c"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    src = Path(tempfile.mkdtemp()) / "paged_attention.c"
    src.write_text(text)
    return kernels.PagedAttention(kernels.build(src))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="main", help="git revision of the kernel to compare against")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lens", default="64,128,192", help="context lengths (every sequence alike)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--isa", default="", help="paths to time (default: the fastest this CPU runs)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16  # SmolLM2-135M; the engine's default block size
    scale = head_dim ** -0.5
    new = kernels.PagedAttention(kernels.build())
    base = base_kernel(args.base)
    isas = args.isa.split(",") if args.isa else [new.isa]
    threads = [int(t) for t in args.threads.split(",")]
    pair = Pair()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {machine().get('model_name', '')}  batch {args.batch}, "
          f"{args.layers} layers, H={heads} K={kv_heads} E={head_dim} block {block_size}")
    for length in [int(n) for n in args.lens.split(",")]:
        data = setup(args.batch, length, args.layers, heads, kv_heads, head_dim, block_size)
        cands = {f"{who}-{isa} {t}t": (k.with_isa(isa), t) for isa in isas for t in threads
                 for who, k in (("base", base), ("new", new))}
        best = dict.fromkeys([*cands, *(f"stream {t}t" for t in threads)], float("inf"))
        outs = {}
        caches, tables, lens, q = data
        for _ in range(args.rounds):
            for name, (kernel, t) in cands.items():
                t0 = time.perf_counter()
                outs[name] = step(kernel, pair, data, block_size, scale, t)
                best[name] = min(best[name], time.perf_counter() - t0)
            for t in threads:  # the floor: the same caches read by torch.sum
                torch.set_num_threads(t)
                t0 = time.perf_counter()
                for kc, vc in caches:
                    kc.sum(), vc.sum()
                best[f"stream {t}t"] = min(best[f"stream {t}t"], time.perf_counter() - t0)
        read = sum(kc.numel() + vc.numel() for kc, vc in caches) * 4
        for t in threads:
            print(f"ctx {length:4d}  stream {t}t        {1e3 * best[f'stream {t}t']:7.2f} ms/step  "
                  f"torch.sum of the {read / 1e6:.0f} MB of caches: {read / best[f'stream {t}t'] / 1e9:.1f} GB/s")
        for name, (kernel, _) in cands.items():
            ref = outs[name.replace("new-", "base-")]
            diff = (outs[name] - ref).abs().max().item()
            alone = torch.empty_like(q[-1][:1])
            kc, vc = caches[-1]
            b = args.batch - 1
            kernel.decode(q[-1][b:], alone, kc, vc, tables[b:], lens[b:], 0, 1, block_size, scale)
            invariant = torch.equal(alone[0], outs[name][b])
            ratio = best[name.replace("new-", "base-")] / best[name]
            print(f"ctx {length:4d}  {name:<16} {1e3 * best[name]:7.2f} ms/step  x{ratio:5.2f} vs base  "
                  f"{read / best[name] / 1e9:5.1f} GB/s  max|diff| {diff:.1e}  alone==batch {invariant}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
