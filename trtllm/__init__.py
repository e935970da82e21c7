"""The TensorRT-LLM executors (NVIDIA GPUs): which adapter serves a model, and building it.

Importing this module never imports `tensorrt_llm` (it is not installable on most machines and
takes seconds to load); `create_trtllm_executor` imports it lazily. Two adapters implement the
`Executor` protocol: `executor.TrtllmExecutor` (the C++ executor binding, prebuilt
TensorRT engines) and `llmapi.TrtllmLlmApi` (`tensorrt_llm.LLM`, the PyTorch backend,
Hugging Face checkpoints). What both share lives in `common`, which imports neither. See
docs/trtllm.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path

from tokenloop.core.executor import Executor
from tokenloop.core.tokenizer import ModelCard

from .common import TrtllmConfig
from .speculative import check_speculative
from .speculative import describe as describe_speculative

log = logging.getLogger("tokenloop.trtllm")

__all__ = ["MISSING_TRTLLM", "TrtllmConfig", "create_trtllm_executor", "is_engine_dir"]

MISSING_TRTLLM = ("--backend trtllm needs TensorRT-LLM: run on NVIDIA's TensorRT-LLM release image "
                  "(nvcr.io/nvidia/tensorrt-llm/release) or `pip install tensorrt-llm` from "
                  "https://pypi.nvidia.com (see docs/trtllm.md)")


def is_engine_dir(path: str | Path) -> bool:
    """A TensorRT engine directory: config.json next to rank0.engine (or any *.engine)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.engine"))


def create_trtllm_executor(model_path: str, config: TrtllmConfig | None = None, **options) -> Executor:
    """Build the adapter for `model_path`; raises RuntimeError (one sentence) without TensorRT-LLM.

    `options` are the `tokenloop serve` flags (`trtllm_api` is the `api` field) and are only
    read when `config` is None.
    """
    if config is None:
        if "trtllm_api" in options:
            options["api"] = options.pop("trtllm_api")
        config = TrtllmConfig(**options)
    if importlib.util.find_spec("tensorrt_llm") is None:
        raise RuntimeError(MISSING_TRTLLM)
    try:
        importlib.import_module("tensorrt_llm")
    except ImportError as exc:  # installed, but e.g. no CUDA driver on this machine
        raise RuntimeError(f"TensorRT-LLM is installed but does not import ({exc}): check the GPU driver "
                           "and CUDA libraries (see docs/trtllm.md)") from None
    card = ModelCard.from_dir(config.tokenizer_dir or model_path)
    api = config.api
    if api == "auto":
        api = "executor" if is_engine_dir(model_path) else "llm"
    check_speculative(config.speculative, api, config.speculative_model, config.num_speculative_tokens)
    log.info("trtllm: %s", describe_speculative(config))
    if api == "executor":
        from .executor import TrtllmExecutor
        return TrtllmExecutor(model_path, config, card.eos_token_ids)
    from .llmapi import TrtllmLlmApi
    return TrtllmLlmApi(model_path, config, card.eos_token_ids)
