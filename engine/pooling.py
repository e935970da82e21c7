"""Embedding requests: which pooling and normalization one gets when it names none (core.request.EmbedParams), and
the pooling of its rows' hidden states step by step (`pool_rows`).

Order, as vLLM for a decoder-only model: the server's flags (--embed-pooling, --embed-normalize) where given, else
the model's sentence-transformers config where it has one (`modules.json` naming a `Pooling` module, whose
`config.json` sets `pooling_mode_*`, and a `Normalize` module or not), else the last token, normalized.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from tokenloop.core.executor import Step
from tokenloop.core.request import POOLINGS, EmbedParams, FinishReason

from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger(__name__)
ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}  # the ones the engine runs


def sentence_transformers_pooling(model_dir: str | Path) -> tuple[str | None, bool | None]:
    """(pooling, normalize) from the model's sentence-transformers files; None where they say nothing (no
    `modules.json`, no Pooling module, or a mode the engine does not run, such as cls: logged)."""
    root = Path(model_dir)
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(modules, list):
        return None, None
    types = [(str(m.get("type", "")), str(m.get("path", ""))) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith(".Normalize") or t == "Normalize" for t, _ in types)
    pooling = None
    for kind, path in types:
        if not kind.endswith("Pooling"):
            continue
        try:
            config = json.loads((root / path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            log.warning("embeddings: %s/config.json unreadable (%s); pooling from the flags or the default", path, exc)
            break
        modes = [mode for key, mode in ST_MODES.items() if config.get(key)]
        others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in ST_MODES]
        if len(modes) == 1 and not others:
            pooling = modes[0]
        else:
            log.warning("embeddings: the model's pooling (%s) is not one the engine runs (%s); pooling from the "
                        "flags or the default", ", ".join(sorted(k for k, v in config.items()
                                                                  if k.startswith("pooling_mode_") and v)) or "none",
                        ", ".join(POOLINGS))
        break
    return pooling, normalize


def embed_defaults(model_dir: str | Path, pooling: str | None = None, normalize: bool | None = None) -> EmbedParams:
    """The EmbedParams of a request that names none: the flags (`pooling`, `normalize`) where given, else the model's
    sentence-transformers config, else last token, normalized."""
    model_pooling, model_normalize = sentence_transformers_pooling(model_dir)
    defaults = EmbedParams()
    return EmbedParams(pooling or model_pooling or defaults.pooling,
                       next(v for v in (normalize, model_normalize, defaults.normalize) if v is not None))


def pool_rows(pooled: list[tuple[Sequence, torch.Tensor]], scheduler: Scheduler) -> list[Step]:
    """Pool each embedding sequence's new rows' final hidden states [n, D]; one whose prompt is all computed ends
    with its vector: its final Step, and the scheduler finishes it (its blocks freed; the full ones stay in the prefix
    cache like any prompt's)."""
    steps = []
    for seq, hidden in pooled:
        seq.pool(hidden)
        if seq.num_uncomputed_tokens == 0:
            steps.append(Step(seq.executor_id, seq.seq_index, [], is_final=True, finish_reason=FinishReason.LENGTH,
                              embedding=seq.embedding(), num_cached_prompt_tokens=seq.num_cached_prompt_tokens or 0))
            scheduler.finish(seq)
    return steps
