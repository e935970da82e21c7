"""The one module of the service that knows the executor packages (tokenloop.engine, tokenloop.trtllm).

It builds the executor `--backend` names (`default_executor_factory`, each package imported lazily), and answers
the start-up checks that need an executor's own knowledge (service/startup.py): is TensorRT-LLM installed, does
the embedded engine know this architecture. What the built executor can do beyond `Executor` is read once from it
(core.capabilities.Capabilities.of, in service/app.py).
"""

from __future__ import annotations

import importlib.util
import os

from tokenloop.core.executor import Executor

from .config import ServerConfig


def default_executor_factory(config: ServerConfig) -> Executor:
    """The executor for `--backend` (imported lazily), wrapped by $TOKENLOOP_DEBUG_FAULT when set."""
    if config.backend == "trtllm":
        from tokenloop.trtllm import create_trtllm_executor
        executor = create_trtllm_executor(config.model, **config.executor_options)
    else:
        from tokenloop.engine.config import EngineConfig
        from tokenloop.engine.engine import Engine
        executor = Engine.from_dir(config.model, EngineConfig(**config.executor_options))
    spec = os.environ.get("TOKENLOOP_DEBUG_FAULT", "")
    if spec:
        from tokenloop.looper.faults import with_faults
        executor = with_faults(executor, spec)
    return executor


def trtllm_missing() -> str | None:
    """Why `--backend trtllm` cannot start here (the tensorrt_llm package is found, not imported: that takes
    seconds and a GPU), or None."""
    from tokenloop.trtllm import MISSING_TRTLLM

    return MISSING_TRTLLM if importlib.util.find_spec("tensorrt_llm") is None else None


def check_engine_architecture(config: dict) -> None:
    """Raises KeyError / TypeError (a field is missing) or ValueError (an architecture the embedded engine does not
    run) for the model's config.json."""
    from tokenloop.engine.loader import ModelConfig

    ModelConfig.from_dict(config)


def check_engine_gguf(path: str) -> None:
    """Raises core.gguf_file.GGUFError (one line: the file, the key or tensor, what we accept) or ValueError for a
    GGUF file the embedded engine cannot serve."""
    from tokenloop.core.gguf_file import check_servable
    from tokenloop.engine.gguf import config_dict
    from tokenloop.engine.loader import ModelConfig

    ModelConfig.from_dict(config_dict(check_servable(path)))
