"""Validate once, at the door: protobuf request -> frozen `ValidRequest`, one named error per rule.

Nothing below this module sees a raw protobuf message. Each rule raises `ValidationError`
with a stable `rule` id and a message naming the field and the rule (tested exactly).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tokenloop.core.request import OutputParams, SamplingParams, StoppingParams, ValidRequest
from tokenloop.core.tokenizer import ChatPrompt, ChatTemplateError, ModelCard, Tokenizer

from .config import LORA_NAME
from .errors import ValidationError
from .structured import structured_of

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM: a smaller temperature is greedy (logits / 1e-45 overflow float32)
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits / 1e-40 overflow float32; the range keeps them finite


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for."""

    max_context_length: int
    max_prompt_tokens: int = 0  # 0: the model's context minus one
    max_new_tokens: int = 4096
    default_max_new_tokens: int = 256
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_length: int = 256
    max_stop_token_ids: int = 256
    max_detokenize_ids: int = 0  # 0: the model's context length
    max_request_id_length: int = 256
    max_grammar_bytes: int = 262144
    allow_special_tokens_in_chat: bool = False  # special-token text in chat content: tokens (True) or text

    def __post_init__(self):
        if self.max_context_length < 2:
            raise ValueError("max_context_length must be >= 2")
        if self.max_detokenize_ids <= 0:
            object.__setattr__(self, "max_detokenize_ids", self.max_context_length)
        if self.max_prompt_tokens <= 0 or self.max_prompt_tokens >= self.max_context_length:
            object.__setattr__(self, "max_prompt_tokens", self.max_context_length - 1)
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens:
            raise ValueError("default_max_new_tokens must be between 1 and max_new_tokens")
        if self.max_n < 1:
            raise ValueError("max_n must be >= 1")


def text_size(request) -> int:
    """What `App.tokenizing` weighs: the characters of a `text` input, the serialized bytes of a `chat` (at least its
    characters), 0 for `token_ids`."""
    which = request.WhichOneof("input")
    if which == "text":
        return len(request.text)
    if which == "chat":
        return request.chat.ByteSize()  # its serialized size: no Python loop over a client's messages
    return 0


def _finite(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise ValidationError(f"{name}_not_finite", f"`{name}` must be a finite number")
    return value


class Validator:
    """Turns protobuf requests into validated dataclasses for one model."""

    def __init__(self, tokenizer: Tokenizer, card: ModelCard, limits: Limits):
        self.tokenizer = tokenizer
        self.card = card
        self.limits = limits
        self.vocab_size = max(card.vocab_size, tokenizer.vocab_size)

    # -- inputs ----------------------------------------------------------------------------
    def chat_messages(self, chat) -> list[dict[str, str]]:
        if not chat.messages:
            raise ValidationError("empty_chat", "`chat.messages` must not be empty")
        # before any per-message work: rendering 100,000 messages holds the GIL for ~0.4 s, and 16 MiB holds millions
        limit = self.limits.max_prompt_tokens
        if len(chat.messages) > limit:
            raise ValidationError("too_many_chat_messages",
                                  f"`chat.messages` may hold at most {limit} messages (the prompt limit in tokens); "
                                  f"got {len(chat.messages)}")
        messages = []
        for i, m in enumerate(chat.messages):
            if m.role not in CHAT_ROLES:
                raise ValidationError("unknown_chat_role",
                                      f"`chat.messages[{i}].role` must be one of {', '.join(CHAT_ROLES)}; "
                                      f"got {m.role!r}")
            messages.append({"role": m.role, "content": m.content})
        return messages

    def render_chat(self, chat) -> ChatPrompt:
        """The conversation rendered; special-token text in content stays text unless
        `--allow-special-tokens-in-chat` (`Tokenizer.render_chat`)."""
        messages = self.chat_messages(chat)
        if self.tokenizer.chat_template is None:
            raise ValidationError("no_chat_template",
                                  "`chat` input needs a model with a chat template; this model has none (send `text`)")
        try:
            return self.tokenizer.render_chat(messages, self.limits.allow_special_tokens_in_chat)
        except ChatTemplateError as exc:
            raise ValidationError("chat_template_failed", f"`chat` could not be rendered: {exc}") from None

    def prompt(self, request) -> tuple[tuple[int, ...], str]:
        """(prompt token ids, prompt text) of a request with a `text` / `token_ids` / `chat` input, within the
        prompt limit."""
        which = request.WhichOneof("input")
        if which is None:
            raise ValidationError("empty_input", "`input` must be set: one of `text`, `token_ids`, `chat`")
        if which == "text":
            if not request.text:
                raise ValidationError("empty_text", "`text` must not be empty")
            chat = None
            text = request.text
        elif which == "chat":
            chat = self.render_chat(request.chat)
            text = chat.text
        else:
            return self.prompt_ids(request.token_ids.ids, "token_ids.ids"), ""
        self.check_text_length(text, which)
        add_bos = self.tokenizer.add_bos
        if chat is None or chat.pieces is None:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=add_bos))
        else:  # special-token text in a message's content: encoded as text
            ids = tuple(self.tokenizer.encode_chat(chat, add_special_tokens=add_bos)[0])
        if not ids:
            raise ValidationError("empty_prompt", f"`{which}` encodes to no tokens")
        self.check_prompt_length(len(ids), which)
        return ids, text

    def check_text_length(self, text: str, field: str) -> None:
        """Refuse, without tokenizing it, a text too long for the prompt limit whatever its tokens: where the
        tokenizer bounds the characters one token stands for (`Tokenizer.max_chars_per_token`), a text longer
        than the limit times that bound needs more tokens than the limit. Tokenizing it would cost about a
        microsecond per byte (16 s for a 16 MiB message) only to refuse it."""
        per_token = self.tokenizer.max_chars_per_token
        limit = self.limits.max_prompt_tokens
        if per_token is not None and len(text) > limit * per_token:
            what = "`text`" if field == "text" else f"the rendered `{field}`"
            raise ValidationError("prompt_too_long",
                                  f"{what} has {len(text)} characters, more than a prompt of at most {limit} tokens "
                                  f"can hold ({limit * per_token}: no token of this tokenizer stands for more than "
                                  f"{per_token})")

    def prompt_ids(self, token_ids, field: str) -> tuple[int, ...]:
        """A prompt given as token ids (`field` names them): not empty, within the prompt limit, in the vocabulary."""
        ids = tuple(token_ids)
        if not ids:
            raise ValidationError("empty_token_ids", f"`{field}` must not be empty")
        self.check_prompt_length(len(ids), field)  # before looking at every id
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValidationError("token_id_out_of_range",
                                  f"`{field}` must be < the vocabulary size {self.vocab_size}; got {bad}")
        return ids

    def check_prompt_length(self, num: int, field: str) -> None:
        """The prompt limit, for a prompt of `num` tokens given in `field` (every API names its own)."""
        if num > self.limits.max_prompt_tokens:
            raise ValidationError("prompt_too_long",
                                  f"the prompt (`{field}`) has {num} tokens; the limit is "
                                  f"{self.limits.max_prompt_tokens} "
                                  "(--max-prompt-tokens)")

    # -- parameters ------------------------------------------------------------------------
    def sampling(self, request) -> SamplingParams:
        return self.sampling_from(request.sampling, "sampling.")

    def sampling_from(self, s, prefix: str) -> SamplingParams:
        """The sampling rules for any message with our field names; `prefix` names the fields as the client's
        API does. Unset optional fields take the model's defaults (top_k and min_p default to 0 either way)."""
        card = self.card
        temperature = _finite(s.temperature, f"{prefix}temperature") if s.HasField("temperature") else (
            card.default_temperature if card.default_temperature is not None else 1.0)
        if temperature < 0:
            raise ValidationError("temperature", f"`{prefix}temperature` must be >= 0")
        if temperature < GREEDY_BELOW_TEMPERATURE:
            temperature = 0.0  # greedy: the same token a tiny temperature would almost surely draw, computably
        top_p = _finite(s.top_p, f"{prefix}top_p") if s.HasField("top_p") else (card.default_top_p or 1.0)
        if not (0 < top_p <= 1):
            raise ValidationError("top_p", f"`{prefix}top_p` must be > 0 and <= 1")
        if s.top_k < 0:
            raise ValidationError("top_k", f"`{prefix}top_k` must be >= 0 (0 disables it)")
        if not (0 <= _finite(s.min_p, f"{prefix}min_p") <= 1):
            raise ValidationError("min_p", f"`{prefix}min_p` must be between 0 and 1")
        rep = _finite(s.repetition_penalty, f"{prefix}repetition_penalty") if s.HasField("repetition_penalty") else 1.0
        low, high = REPETITION_PENALTY_RANGE
        if not (low <= rep <= high):
            raise ValidationError("repetition_penalty",
                                  f"`{prefix}repetition_penalty` must be between {low:g} and {high:g} (1 disables it); "
                                  f"got {rep:.3g}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2 <= _finite(getattr(s, name), f"{prefix}{name}") <= 2):
                raise ValidationError(name, f"`{prefix}{name}` must be between -2 and 2")
        seed = s.seed if s.HasField("seed") else random.getrandbits(63)
        return SamplingParams(temperature=temperature, top_k=s.top_k, top_p=top_p, min_p=s.min_p,
                              repetition_penalty=rep, presence_penalty=s.presence_penalty,
                              frequency_penalty=s.frequency_penalty, seed=seed)

    def stopping(self, request, num_prompt: int) -> StoppingParams:
        """The stopping rules of a `GenerateRequest` whose stop lists `generate` checked (`stop_lists`, before
        tokenizing)."""
        st = request.stopping
        max_new = self.new_token_limits(st.max_new_tokens if st.HasField("max_new_tokens") else None,
                                        st.min_new_tokens, num_prompt, "stopping.max_new_tokens",
                                        "stopping.min_new_tokens")
        params = StoppingParams(max_new_tokens=max_new, min_new_tokens=st.min_new_tokens, stop=tuple(st.stop),
                                stop_token_ids=tuple(st.stop_token_ids), ignore_eos=st.ignore_eos,
                                include_stop_str_in_output=st.include_stop_str_in_output)
        self.check_min_new_tokens(params, "stopping.stop_token_ids", "stopping.min_new_tokens")
        return params

    def check_min_new_tokens(self, stopping: StoppingParams, stop_field: str, min_field: str) -> None:
        """Refuse stop token ids that, with EOS, cover the whole vocabulary while min_new_tokens holds them all
        back: no token could be generated (either API; errors name its fields)."""
        if stopping.min_new_tokens <= 0 or not stopping.stop_token_ids:
            return
        vocab = self.card.vocab_size or self.vocab_size  # the width of the model's logits
        held = set(stopping.stop_token_ids) | (set() if stopping.ignore_eos else set(self.card.eos_token_ids))
        if sum(1 for t in held if t < vocab) >= vocab:
            raise ValidationError("no_token_allowed",
                                  f"`{stop_field}`{'' if stopping.ignore_eos else ' with EOS'} cover the whole "
                                  f"vocabulary ({vocab} "
                                  f"tokens): with `{min_field}` {stopping.min_new_tokens} no token could be generated")

    def new_token_limits(self, max_new: int | None, min_new: int, num_prompt: int, max_field: str,
                         min_field: str) -> int:
        """The checked max_new_tokens of either API (None: unset, so the default capped by the context left);
        errors name that API's fields."""
        lim = self.limits
        room = lim.max_context_length - num_prompt
        if max_new is not None:
            if not (1 <= max_new <= lim.max_new_tokens):
                raise ValidationError("max_new_tokens",
                                      f"`{max_field}` must be between 1 and {lim.max_new_tokens}; got {max_new}")
            if max_new > room:
                raise ValidationError("context_exceeded",
                                      f"the prompt ({num_prompt} tokens) plus `{max_field}` ({max_new}) exceeds the "
                                      f"model's context of {lim.max_context_length} tokens")
        else:
            max_new = min(lim.default_max_new_tokens, room)
        if min_new > max_new:
            raise ValidationError("min_new_tokens",
                                  f"`{min_field}` ({min_new}) must be <= {max_field.rsplit('.', 1)[-1]} ({max_new})")
        return max_new

    def stop_lists(self, stop, stop_token_ids, prefix: str) -> None:
        """The rules on stop strings and stop token ids; `prefix` names the fields as the client's API does."""
        lim = self.limits
        if len(stop) > lim.max_stop_strings:
            raise ValidationError("too_many_stop_strings",
                                  f"`{prefix}stop` may hold at most {lim.max_stop_strings} strings; got {len(stop)}")
        for i, text in enumerate(stop):
            if not (0 < len(text) <= lim.max_stop_string_length):
                raise ValidationError("stop_string_length",
                                      f"`{prefix}stop[{i}]` must be 1 to {lim.max_stop_string_length} characters long")
        if len(stop_token_ids) > lim.max_stop_token_ids:
            raise ValidationError("too_many_stop_token_ids",
                                  f"`{prefix}stop_token_ids` may hold at most {lim.max_stop_token_ids} ids "
                                  f"(--max-stop-token-ids); got {len(stop_token_ids)}")
        bad = next((t for t in stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValidationError("stop_token_id_out_of_range",
                                  f"`{prefix}stop_token_ids` must be < the vocabulary size {self.vocab_size}; "
                                  f"got {bad}")

    def detokenize_ids(self, ids) -> None:
        """The rules on Detokenize's `token_ids`: how many (before looking at any), then each one's range."""
        limit = self.limits.max_detokenize_ids
        if len(ids) > limit:
            raise ValidationError("too_many_detokenize_ids",
                                  f"`token_ids` may hold at most {limit} ids (--max-detokenize-ids); got {len(ids)}")
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValidationError("token_id_out_of_range",
                                  f"`token_ids` must be < the vocabulary size {self.vocab_size}; got {bad}")

    def output(self, request) -> OutputParams:
        o = request.output
        if o.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValidationError("top_logprobs",
                                  f"`output.top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}; "
                                  f"got {o.top_logprobs}")
        skip = o.skip_special_tokens if o.HasField("skip_special_tokens") else True
        return OutputParams(logprobs=o.logprobs or o.top_logprobs > 0, top_logprobs=o.top_logprobs,
                            skip_special_tokens=skip, echo=o.echo)

    def request_id(self, request_id: str) -> str:
        if not (len(request_id) <= self.limits.max_request_id_length and request_id.isprintable()):
            raise ValidationError("request_id",
                                  f"`request_id` must be printable and at most {self.limits.max_request_id_length} "
                                  "characters")
        return request_id

    # -- the whole request -----------------------------------------------------------------
    def generate(self, request, request_id: str, deadline: float | None = None) -> ValidRequest:
        """Validate a `GenerateRequest`; raises ValidationError naming the first broken rule. A `structured`
        constraint is checked but not compiled (`App.grammars.admit` does that)."""
        n = request.n or 1
        if not (1 <= n <= self.limits.max_n):
            raise ValidationError("n", f"`n` must be between 1 and {self.limits.max_n}; got {n}")
        self.stop_lists(request.stopping.stop, request.stopping.stop_token_ids, "stopping.")  # before tokenizing
        structured = structured_of(request, self.limits.max_grammar_bytes)
        ids, text = self.prompt(request)
        return ValidRequest(
            request_id=self.request_id(request_id), prompt_token_ids=ids, sampling=self.sampling(request),
            stopping=self.stopping(request, len(ids)), output=self.output(request), n=n,
            stream=request.stream, prompt_text=text, deadline=deadline, structured=structured,
            lora=self.lora_name(request.lora))

    @staticmethod
    def lora_name(name: str) -> str:
        """`lora`: empty (the base model) or an adapter's name (LORA_NAME), checked before it is looked up."""
        if name and LORA_NAME.fullmatch(name) is None:
            raise ValidationError("lora_name",
                                  "`lora` must be empty (the base model) or an adapter's name: 1-128 letters, digits, "
                                  "'.', '_' or '-' starting with a letter or digit")
        return name
