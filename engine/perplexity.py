"""Perplexity of the engine's model on a text: how `--weights int8` and `int4` are held to fp32 (docs/engine.md).

    .venv/bin/python -m tokenloop.engine.perplexity [--model DIR] [--weights fp32,int8,int4] [--text FILE]

The text is cut into windows of `--window` tokens; each window runs as one fresh prefill (the engine's own
forward pass, the same kernels that serve requests) and every token after a window's first is scored.
Perplexity = exp(mean negative log-likelihood). The default text is tests/data/perplexity-en.txt (2,735
tokens of plain English written for this, CC0).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from .batch import ForwardBatch, fresh_group
from .config import EngineConfig
from .engine import Engine

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = ROOT / "tests" / "data" / "perplexity-en.txt"
DEFAULT_WINDOW = 512


def load_engine(model_dir: str | Path, weights: str, window: int = DEFAULT_WINDOW, kv_dtype: str = "auto") -> Engine:
    """An engine whose thread is not started: only its model's forward pass is used."""
    return Engine(model_dir, EngineConfig(weights=weights, kv_cache_tokens=max(window, 16), max_num_tokens=window,
                                          max_batch_size=1, kv_dtype=kv_dtype), start=False)


@torch.inference_mode()
def perplexity(engine: Engine, ids: list[int], window: int = DEFAULT_WINDOW) -> tuple[float, int]:
    """(perplexity, tokens scored) of `ids` under the engine's model, in windows of `window` tokens."""
    nll, count = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        n = len(chunk)
        if n < 2:
            break
        rows = torch.arange(n)
        batch = ForwardBatch(input_ids=torch.tensor(chunk), positions=rows, slot_mapping=rows,
                             groups=[fresh_group(0, n)], logits_rows=rows)
        logits = engine.model.forward(batch)[:-1].double()  # [n-1, V]: the prediction of each next token
        targets = torch.tensor(chunk[1:])[:, None]
        nll -= float(torch.log_softmax(logits, dim=-1).gather(1, targets).sum())
        count += n - 1
    return math.exp(nll / count), count


def main(argv: list[str] | None = None) -> int:
    from tokenloop.core.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--weights", default="fp32,int8,int4", help="comma-separated weight modes")
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    args = parser.parse_args(argv)
    ids = Tokenizer.from_dir(args.model).encode(Path(args.text).read_text())
    first = None
    print("| weights | perplexity | vs first | tokens | seconds |\n| --- | --- | --- | --- | --- |")
    for weights in args.weights.split(","):
        engine = load_engine(args.model, weights, args.window)
        started = time.perf_counter()
        ppl, count = perplexity(engine, ids, args.window)
        first = first or ppl
        print(f"| {weights} | {ppl:.4f} | {100 * (ppl / first - 1):+.2f} % | {count} | "
              f"{time.perf_counter() - started:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
