"""What a request must satisfy to enter the engine, beyond what service validation checks at the door: the model's
context and vocabulary, the KV cache's size, and what the engine's validation must already have done."""

from __future__ import annotations

from tokenloop.core.request import ValidRequest


def check_request(request: ValidRequest, max_context_length: int, vocab_size: int, kv_capacity: int) -> None:
    """Raise ValueError, saying which rule, for a request this engine cannot serve: a model of `max_context_length`
    tokens and `vocab_size` token ids, over a KV cache of `kv_capacity` tokens."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) >= max_context_length:
        raise ValueError(f"the prompt has {len(prompt)} tokens; this model takes at most "
                         f"{max_context_length - 1} so that one can be generated")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt token ids must be in 0..{vocab_size - 1}")
    if request.n < 1:
        raise ValueError(f"n must be >= 1, got {request.n}")
    if request.embed is not None and (request.n != 1 or request.structured is not None):
        raise ValueError("an embedding request has n 1 and no `structured` constraint")
    if request.structured is not None and request.structured.grammar is None:
        raise ValueError(f"`{request.structured.kind}` was not compiled (validation compiles it)")
    need = min(len(prompt) + request.stopping.max_new_tokens, max_context_length)
    if need > kv_capacity:
        raise ValueError(f"prompt plus max_new_tokens ({need} tokens) exceeds the KV cache ({kv_capacity} tokens)")
