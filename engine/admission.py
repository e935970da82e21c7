"""What a request must satisfy to enter the engine, beyond what service validation checks at the door: the model's
context and vocabulary, the KV cache's size, and what the engine's validation must already have done.

These are backstops (the door refuses such requests first, with the same rules); a refusal is an `AdmissionError`
(a ValueError, so INVALID_ARGUMENT at the looper) whose message names the field and the rule, and whose `rule` is a
stable identifier, like service validation's."""

from __future__ import annotations

from tokenloop.core.request import ValidRequest


class AdmissionError(ValueError):
    """A request this engine cannot serve; the message names the field and the rule, `rule` identifies it."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"{message} (engine admission: {rule})")
        self.rule = rule


def check_request(request: ValidRequest, max_context_length: int, vocab_size: int, kv_capacity: int) -> None:
    """Raise AdmissionError for a request this engine cannot serve: a model of `max_context_length` tokens and
    `vocab_size` token ids, over a KV cache of `kv_capacity` tokens."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise AdmissionError("empty_prompt", "`prompt_token_ids` must not be empty")
    if len(prompt) >= max_context_length:
        raise AdmissionError("prompt_too_long", f"`prompt_token_ids` has {len(prompt)} tokens; this model takes at "
                             f"most {max_context_length - 1} so that one can be generated")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(t for t in prompt if t < 0 or t >= vocab_size)
        raise AdmissionError("token_id_out_of_range",
                             f"`prompt_token_ids` must be in 0..{vocab_size - 1}; got {bad}")
    if request.n < 1:
        raise AdmissionError("n_too_small", f"`n` must be >= 1; got {request.n}")
    if request.embed is not None and request.n != 1:
        raise AdmissionError("embed_n", f"`n` must be 1 for an embedding request; got {request.n}")
    if request.embed is not None and request.structured is not None:
        raise AdmissionError("embed_structured", "`structured` must be unset for an embedding request")
    if request.structured is not None and request.structured.grammar is None:
        raise AdmissionError("structured_not_compiled", f"`structured.{request.structured.kind}` must be compiled "
                             "before the engine (service validation compiles it)")
    need = min(len(prompt) + request.stopping.max_new_tokens, max_context_length)
    if need > kv_capacity:
        raise AdmissionError("kv_cache_too_small", f"`prompt_token_ids` plus `max_new_tokens` ({need} tokens) must "
                             f"fit the KV cache ({kv_capacity} tokens)")
