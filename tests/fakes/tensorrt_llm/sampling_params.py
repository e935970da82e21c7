"""Fake `tensorrt_llm.sampling_params`: SamplingParams with the real fields tokenloop uses and the real validation
(`best_of >= n`; greedy decoding refuses best_of > 1), and GuidedDecodingParams (tensorrt_llm/sampling_params.py
@ 000a01de66f0eab4ab05640711f0253f50f5209c: keyword-only, one guide at a time)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: str | dict | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def _validate(self):
        num_guides = sum(bool(getattr(self, f.name)) for f in fields(self))
        if num_guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {num_guides}.")


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    guided_decoding: GuidedDecodingParams | None = None
    return_perf_metrics: bool = False  # CompletionOutput.request_perf_metrics (speculative_decoding's counts)

    def __post_init__(self):
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        if self.best_of > 1 and self._greedy_decoding and not os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING"):
            raise ValueError("Greedy decoding in the LLM API does not allow multiple returns.")

    @property
    def _greedy_decoding(self) -> bool:
        return (not self.use_beam_search and (self.top_k is None or self.top_k == 1)
                and (self.top_p is None or self.top_p == 0.0))

    def _get_stop_reasons_and_words(self) -> list[tuple[int, list[int]]]:
        return [(t, [t]) for t in (self.stop_token_ids or [])]
