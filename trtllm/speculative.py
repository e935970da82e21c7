"""TensorRT-LLM's own speculative decoding, passed through from `--speculative` (docs/trtllm.md, "Speculative
decoding"). Imports no `tensorrt_llm`: each adapter hands in the module whose classes it builds.

Written against NVIDIA/TensorRT-LLM:
  tensorrt_llm/llmapi/llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412 (DecodingBaseConfig: max_draft_len,
      speculative_model (alias speculative_model_dir), max_concurrency; NGramDecodingConfig: max_matching_ngram_size,
      is_keep_all, is_use_oldest, is_public_pool, PyTorch backend only, max_draft_len > 0; DraftTargetDecodingConfig:
      max_draft_len > 0 and speculative_model required; LookaheadDecodingConfig: max_window_size, max_ngram_size,
      max_verification_set_size, each > 0; the LLM takes one as `speculative_config`)
  cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp @ 008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc
      (DecodingConfig(decoding_mode=None, lookahead_decoding_config=None, medusa_choices=None, eagle_config=None);
      ExecutorConfig(decoding_config=...)), and the bindings' LookaheadDecodingConfig(max_window_size,
      max_ngram_size, max_verification_set_size) and DecodingMode.Lookahead().

What TensorRT-LLM reports back (`SpecCounts`, `draft_counts`), written against:
  cpp/include/tensorrt_llm/executor/types.h @ a98a9061d72f6fd39f5d055ebdd2c6878a100e2c (SpecDecodingStats:
      numDraftTokens, numAcceptedTokens, numRequestsWithDraftTokens, acceptanceLength, per iteration, in
      `IterationStats.to_json_str()` and `LLM.get_stats_async` as `specDecodingStats`;
      RequestPerfMetrics::SpeculativeDecodingMetrics: acceptanceRate, totalAcceptedDraftTokens, totalDraftTokens)
  cpp/tensorrt_llm/nanobind/executor/request.cpp @ ac456dcad7e63b0ee6387ebb2ee2ef330d142ebe (OutputConfig(...,
      return_perf_metrics=None); Result.request_perf_metrics, RequestPerfMetrics.speculative_decoding with
      acceptance_rate, total_accepted_draft_tokens, total_draft_tokens; Result.decoding_iter)
  tensorrt_llm/executor/result.py @ a678b91aafbeff265cd0b764abb59d7def624ac2 (CompletionOutput.request_perf_metrics,
      copied from each response's Result when set) and tensorrt_llm/sampling_params.py (SamplingParams
      .return_perf_metrics, "in sync with tllme.OutputConfig").

The C++ executor runs the speculation its TensorRT engine was built with (`trtllm-build --speculative_decoding_mode
...`); of the run-time settings it takes lookahead's window, n-gram and verification-set sizes. The LLM API
(PyTorch backend) drafts by n-gram, by lookahead or with a draft model.
"""

from __future__ import annotations

from dataclasses import dataclass

TRTLLM_SPECULATIVE_MODES = ("off", "ngram", "lookahead", "draft_target")
DEFAULT_DRAFT_LEN = 4  # max_draft_len when --num-speculative-tokens is not given (the embedded engine's default K)
LLM_CLASSES = {"ngram": "NGramDecodingConfig", "lookahead": "LookaheadDecodingConfig",
               "draft_target": "DraftTargetDecodingConfig"}


def check_speculative(mode: str, api: str, speculative_model: str | None, num_tokens: int | None) -> None:
    """The combinations TensorRT-LLM runs; ValueError naming the flag otherwise. `api`: llm | executor | auto."""
    if mode not in TRTLLM_SPECULATIVE_MODES:
        raise ValueError(f"--speculative must be one of {', '.join(TRTLLM_SPECULATIVE_MODES)}; got {mode!r}")
    if num_tokens is not None and num_tokens < 1:
        raise ValueError(f"--num-speculative-tokens must be >= 1; got {num_tokens}")
    if mode == "draft_target" and not speculative_model:
        raise ValueError("--speculative draft_target needs --speculative-model DIR (the draft model)")
    if speculative_model and mode != "draft_target":
        raise ValueError("--speculative-model is read only with --speculative draft_target")
    if api == "executor" and mode in ("ngram", "draft_target"):
        raise ValueError(f"--speculative {mode} needs TensorRT-LLM's LLM API (--trtllm-api llm): the C++ executor "
                         "runs the speculation its engine was built with, and takes only lookahead's settings")


def llm_speculative_kwargs(mode: str, num_tokens: int | None, max_batch_size: int | None,
                           speculative_model: str | None, lookahead: tuple[int, int, int] | None) -> dict:
    """The keyword arguments of the LLM API's decoding config for `mode` (class name: LLM_CLASSES[mode])."""
    kwargs: dict = {}
    if mode == "lookahead":
        if lookahead is not None:
            kwargs.update(zip(("max_window_size", "max_ngram_size", "max_verification_set_size"), lookahead))
    else:
        kwargs["max_draft_len"] = num_tokens or DEFAULT_DRAFT_LEN
    if mode == "draft_target":
        kwargs["speculative_model"] = speculative_model
    if max_batch_size is not None:
        kwargs["max_concurrency"] = max_batch_size  # speculation off above this batch size (PyTorch backend)
    return kwargs


def llm_speculative_config(llmapi, config):
    """The `speculative_config` argument of `tensorrt_llm.LLM` for a TrtllmConfig (from `tensorrt_llm.llmapi`), or
    None when speculation is off."""
    if config.speculative == "off":
        return None
    cls = getattr(llmapi, LLM_CLASSES[config.speculative])
    return cls(**llm_speculative_kwargs(config.speculative, config.num_speculative_tokens,
                                        config.speculative_max_batch_size, config.speculative_model,
                                        config.lookahead_config))


def executor_decoding_config(tle, config):
    """`ExecutorConfig.decoding_config` for a TrtllmConfig (from `tensorrt_llm.bindings.executor`): lookahead's
    mode and sizes, or None (the engine's own decoding mode)."""
    if config.speculative != "lookahead":
        return None
    sizes = config.lookahead_config
    lookahead = tle.LookaheadDecodingConfig(*sizes) if sizes is not None else None
    return tle.DecodingConfig(decoding_mode=tle.DecodingMode.Lookahead(), lookahead_decoding_config=lookahead)


def describe(config) -> str:
    """The start-up log's words for the speculation asked of TensorRT-LLM."""
    if config.speculative == "off":
        return "speculative decoding off"
    if config.speculative == "lookahead":
        sizes = config.lookahead_config
        return "speculative decoding lookahead" + (" (W,N,G %d,%d,%d)" % sizes if sizes else " (TensorRT-LLM's sizes)")
    extra = f", draft model {config.speculative_model}" if config.speculative == "draft_target" else ""
    return (f"speculative decoding {config.speculative} (up to {config.num_speculative_tokens or DEFAULT_DRAFT_LEN} "
            f"tokens{extra})")


@dataclass(slots=True)
class SpecCounts:
    """TensorRT-LLM's per-iteration `specDecodingStats` summed since start: the engine's spec_decode counters
    (verifications of a draft, drafted tokens, accepted drafted tokens), as GetLoad and /metrics report them."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, iteration: dict) -> None:
        """Count one iteration's stats (the JSON names of `IterationStats.to_json_str()`)."""
        spec = iteration.get("specDecodingStats") or {}
        self.num_drafts += int(spec.get("numRequestsWithDraftTokens", 0))
        self.num_draft_tokens += int(spec.get("numDraftTokens", 0))
        self.num_accepted_tokens += int(spec.get("numAcceptedTokens", 0))


def perf_metrics_kwargs(mode: str, factory) -> dict:
    """The keyword that asks a request's perf metrics (its drafted and accepted tokens) of `factory`
    (`SamplingParams` on the LLM API, `OutputConfig` on the executor) when speculating and when this TensorRT-LLM
    release takes it; {} otherwise (an older release then reports no counts rather than refusing every request)."""
    if mode == "off":
        return {}
    try:
        factory(return_perf_metrics=True)
    except TypeError:
        return {}
    return {"return_perf_metrics": True}


def draft_counts(perf_metrics) -> tuple[int, int] | None:
    """(drafted, accepted) tokens of a request so far, from a `RequestPerfMetrics` (`Result.request_perf_metrics`
    on the executor, `CompletionOutput.request_perf_metrics` on the LLM API); None when it carries none."""
    spec = getattr(perf_metrics, "speculative_decoding", None)
    if spec is None:
        return None
    return int(spec.total_draft_tokens), int(spec.total_accepted_draft_tokens)
