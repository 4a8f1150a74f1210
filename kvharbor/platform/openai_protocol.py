"""OpenAI-compatible request bodies (the responses are in ``openai_responses``, the error body in
``error_body``).

Every error the gateway answers has the body ``{"error": {"message", "type", "param",
"code"}}`` (``ErrorResponse``); the message says what to change. Request models reject
values the engine cannot run (a seed outside 64 bits, more than 8 stop strings, non-text
content parts) so that no client input can reach the engine loop and fail it there.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, Field, StringConstraints, WithJsonSchema,
                      field_validator, model_validator)

from kvharbor.engine.tokenizer import template_kwargs

from .error_body import FieldError
from .json_types import REQUEST_FIELDS
from .service_tier import DOC as SERVICE_TIER_DOC, ServiceTier
from .structured_request import ResponseFormat, StructuredOutputs, structured_spec
from .tool_calls import (MAX_TOOLS, Tool, ToolCall, ToolChoice, constraint, template_calls, template_tools,
                         tool_mode)

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 64
GREEDY_BELOW = 1e-5
"""Temperatures below this are treated as 0 (greedy): dividing logits by them overflows."""


def _encodable(text: str) -> str:
    """Reject lone surrogates (JSON may carry ``"\\ud800"``): they cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text must be valid Unicode; there is a lone surrogate at character "
                         f"{e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
"""A string that encodes to UTF-8 (every string the gateway tokenizes or echoes)."""


MAX_MESSAGES = 512
"""Most messages in one chat request (each is templated and tokenized by the gateway)."""
MAX_PROMPT_TOKEN_IDS = 131_072
"""Most token ids in one completions prompt (the context check then applies)."""
MAX_N = 8
"""Most choices (``n``) per prompt."""
MAX_PROMPTS = 32
"""Most prompts in one completions request (a batch: a list of texts or of token-id lists)."""
MAX_CHOICES = 64
"""Most choices per completions request: prompts x ``n``."""
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
"""Most entries in ``logit_bias`` (OpenAI's limit)."""


def _keeps_some(value: int | None) -> int | None:
    if value == 0:
        raise ValueError("must be at least 1 (the tokens to keep), or -1 (as many as the context holds)")
    return value


TruncateTokens = Annotated[int | None, AfterValidator(_keeps_some)]
"""vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (>= 1), -1 as many as fit, or None."""


def unsupported(tp, *neutral):
    """The type of a field of OpenAI's API that kvharbor does not implement.

    ``None`` and the ``neutral`` values (those that ask for the default behaviour, e.g.
    ``echo: false``) pass; any other value is refused with a message naming the
    field, so an SDK user gets an error rather than an answer that ignored the option. The
    OpenAPI schema lists exactly the accepted values.
    """
    def check(value):
        if value is None or any(type(value) is type(n) and value == n for n in neutral):
            return value
        allowed = " or ".join(["null"] + [json.dumps(n) for n in neutral])
        raise ValueError(f"is not supported by kvharbor; omit it (or send {allowed})")

    def schema_of(n) -> dict:
        if n == {} or n == []:
            return {"type": "object", "maxProperties": 0} if n == {} else {"type": "array", "maxItems": 0}
        return {"const": n}
    schema = {"anyOf": [{"type": "null"}] + [schema_of(n) for n in neutral],
              "description": "Not supported: only " + " or ".join(["null"] + [json.dumps(n) for n in neutral])}
    return Annotated[tp, AfterValidator(check), WithJsonSchema(schema)]


NullOnlyStr = unsupported(str | None)
NullOnlyDict = unsupported(dict | None)
EmptyList = unsupported(list[dict] | None, [])


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """``logit_bias``'s keys as token ids (the gateway checks them against the vocabulary)."""
    bad = next((k for k in bias if not (k.isascii() and k.isdigit() and len(k) <= 9)), None)
    if bad is not None:
        raise ValueError(f"keys are token ids written as strings of digits, got {bad[:20]!r}")
    return {int(k): v for k, v in bias.items()}


LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS),
    AfterValidator(_token_keys),
    WithJsonSchema({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                    "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})]


TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True})]
"""A token id (``prompt_shape`` refuses a negative one in a prompt first). The gateway sets the
served model's bound in its schema (``bound_token_ids``)."""


def bound_token_ids(schema, vocab_size: int) -> None:
    """Give every token id of an OpenAPI ``schema`` the ``maximum`` of a vocabulary this size."""
    if isinstance(schema, dict):
        if schema.pop("x-token-id", False):
            schema["maximum"] = vocab_size - 1
        for value in schema.values():
            bound_token_ids(value, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            bound_token_ids(value, vocab_size)


CacheKey = Annotated[str, StringConstraints(min_length=1, max_length=1024), AfterValidator(_encodable)] | None
CACHE_KEY_DOC = ("OpenAI's: requests of this tenant sending the same key (up to 1,024 characters) go to the same "
                 "LLM replica, the key's home, unless it is overloaded or another replica already holds more of the "
                 "prompt: send one key for requests that share a long prompt prefix (an agent's system prompt and "
                 "tools, one user's conversation). A routing hint only: which requests may share cached blocks is "
                 "set by the tenant's cache scope and cache_salt.")
CacheRetention = unsupported(str | None, "in_memory")
CACHE_RETENTION_DOC = ("OpenAI's: only \"in_memory\" or null: cached prefixes stay in the replicas' memory until "
                       "other prompts evict them; kvharbor has no extended (24h) retention.")


def _ignored(what: str) -> str:
    return f"Accepted and ignored: {what}."


class RepetitionDetection(BaseModel):
    """vLLM's ``repetition_detection`` (``kvharbor.engine.repetition``)."""

    model_config = REQUEST_FIELDS
    max_pattern_size: int = Field(0, ge=0, le=1024, description="Longest pattern looked for, in tokens (0: off).")
    min_pattern_size: int = Field(0, ge=0, le=1024, description="Shortest pattern looked for (0: 1).")
    min_count: int = Field(0, ge=0, le=1024, description="Times in a row a pattern must occur (>= 2 when on).")

    @model_validator(mode="after")
    def _servable(self):
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError("min_pattern_size must be at most max_pattern_size")
        if self.max_pattern_size and self.min_count < 2:
            raise ValueError("min_count must be at least 2 (the times a pattern repeats in a row)")
        return self


class StreamOptions(BaseModel):
    model_config = REQUEST_FIELDS
    include_usage: bool | None = Field(False, description="Send a final chunk with token usage.")
    continuous_usage_stats: bool | None = Field(False, description="With include_usage, every chunk also "
                                                "carries the usage so far (as in vLLM). A chunk may hold "
                                                "several tokens (the QoS class's stream_interval): this "
                                                "is how a client counts tokens as they arrive.")
    include_obfuscation: bool | None = Field(None, description=_ignored("no obfuscation padding is sent"))


_MODEL_DEFAULT = " Default: the model's generation config (see the generation_config option), else "
SAMPLING_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""The sampling fields a request may leave to the server's defaults, with their neutral values."""

BEAM_SEARCH_REFUSES = {"stop": (None, []),
                       **{name: (None, SAMPLING_NEUTRAL[name])
                          for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")},
                       "logit_bias": (None, {}), "bad_words": (None, []), "allowed_token_ids": (None,),
                       "repetition_detection": (None,), "thinking_token_budget": (None, -1)}
"""The fields a beam search cannot honour, with the values that ask for nothing."""


class _Common(BaseModel):
    """Fields both generation routes share. Unknown fields are a 400 (``extra="forbid"``)."""

    model_config = REQUEST_FIELDS
    model: Text = Field(description="Model id, as listed by /v1/models.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate (>= 1). Default: the generation config's max_new_tokens (see the generation_config option), else the tenant's max_tokens_per_request (256 when it sets none); at most that and the rest of the context.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description=f"Sampling temperature in [0, 2]; 0 (or below {GREEDY_BELOW}) is greedy.{_MODEL_DEFAULT}1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description=f"Nucleus sampling mass in (0, 1].{_MODEL_DEFAULT}1.")
    top_k: int | None = Field(None, ge=0, description=f"Keep only the k most likely tokens (0: off).{_MODEL_DEFAULT}0. Not in OpenAI's API.")
    n: int | None = Field(1, ge=1, le=MAX_N, description=f"Number of choices (1 to {MAX_N}); they share the prompt's KV cache.")
    stream: bool | None = Field(False, description="Stream Server-Sent Events ending in `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    stop: Text | list[Text] | None = Field(None, description=f"Stop strings (up to {MAX_STOP_STRINGS}, each up to {MAX_STOP_CHARS} characters).")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS, description=f"Stop at any of these token ids (up to {MAX_STOP_TOKEN_IDS}); the stop token's text is left out of the answer (EOS's too), as in vLLM. Not in OpenAI's API.")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Seed for reproducible sampling (a signed 64-bit integer).")
    ignore_eos: bool = Field(False, description="Keep generating after the end-of-sequence token. Not in OpenAI's API.")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_PROMPT_TOKEN_IDS, description="Only these token ids may be generated (vLLM's). Not in OpenAI's API.")
    bad_words: list[Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(None, max_length=MAX_BAD_WORDS, description=f"Words never generated, up to {MAX_BAD_WORDS} of up to {MAX_STOP_CHARS} characters (vLLM's: a word's last token is banned where the output ends with its other tokens, the word spelt alone and after a space). Not in OpenAI's API.")
    truncate_prompt_tokens: TruncateTokens = Field(None, ge=-1, description="Keep only the prompt's last this many tokens (vLLM's; after the chat template on chat; usage counts what is kept); -1: as many as the context holds with room for one token to generate. Not in OpenAI's API.")
    truncation_side: Literal["left", "right"] | None = Field(None, description="With truncate_prompt_tokens (vLLM's): \"left\" (the default) cuts the prompt's start, keeping its last tokens; \"right\" cuts its end, keeping its first tokens. Not in OpenAI's API.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens (e.g. the end-of-sequence token) out of the text (vLLM's). Not in OpenAI's API.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string or stop token (EOS included) that ended the answer at its end (vLLM's; text after it is still cut). Not in OpenAI's API.")
    user: str | None = Field(None, description=_ignored("end-user id"))
    prompt_cache_key: CacheKey = Field(None, description=CACHE_KEY_DOC)
    prompt_cache_retention: CacheRetention = Field(None, description=CACHE_RETENTION_DOC)
    service_tier: ServiceTier | None = Field(None, description=SERVICE_TIER_DOC)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description=f"In [-2, 2]: subtracted from a token's logit once per time it occurs in the output so far (OpenAI's formula).{_MODEL_DEFAULT}0.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description=f"In [-2, 2]: subtracted from a token's logit once it occurs in the output so far (OpenAI's formula).{_MODEL_DEFAULT}0.")
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False, description=f"Above 0 (1: off): a token in the prompt or the output so far has its logit divided by it when positive, multiplied when not (as vLLM).{_MODEL_DEFAULT}1. Not in OpenAI's API.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description=f"In [0, 1]: sample only tokens at least min_p times as likely as the most likely one (as vLLM).{_MODEL_DEFAULT}0. Not in OpenAI's API.")
    min_tokens: int | None = Field(0, ge=0, description="Generate at least this many tokens (at most max_tokens): until then EOS and stop_token_ids cannot be picked and stop strings are not looked for (as vLLM). Not in OpenAI's API.")
    logit_bias: LogitBias | None = Field(None, description=f"Token id (as a string) to a bias in [-100, 100] added to its logit before sampling, at most {MAX_LOGIT_BIAS} entries; -100 in effect bans a token, 100 forces it.")
    response_format: ResponseFormat | None = Field(None, description='OpenAI\'s: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}} constrains the output to JSON (to that schema); {"type": "text"} or null does not.')
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: the output follows a JSON schema, a regex, one of a list of strings or an EBNF grammar. Not in OpenAI's API; not with response_format.")
    return_tokens_as_token_ids: bool | None = Field(False, description="vLLM's: logprobs name each token as the string token_id:<id> (chat's bytes stay its text's). Not in OpenAI's API.")
    return_token_ids: bool | None = Field(False, description="vLLM's: each choice also carries its output's token_ids, and the answer the prompt's prompt_token_ids (chat: on the response; completions: on each choice); streamed, each chunk the ids of its tokens and the first chunk the prompt's. Not in OpenAI's API.")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=f"vLLM's: the answer also carries prompt_logprobs, each prompt token's log-probability given the tokens before it, with its rank in the vocabulary and the this many most likely tokens there (0 to {MAX_TOP_LOGPROBS}); the first token's entry is null. Not with stream (0 is accepted there and answers nothing, as vLLM). The prompt is computed in full, not read from the prefix cache. Not in OpenAI's API.")
    thinking_token_budget: int | None = Field(None, ge=-1, description="vLLM's: with a reasoning parser, after this many tokens of thought the answer's next tokens are forced to close it (</think>) and the model answers; -1 or null: no budget. Not in OpenAI's API.")
    repetition_detection: RepetitionDetection | None = Field(None, description="vLLM's: the answer ends (finish_reason \"repetition\", stop_reason \"repetition_detected\") as soon as its last tokens are one pattern of min_pattern_size to max_pattern_size tokens repeated min_count times in a row (a model caught in a loop). Not in OpenAI's API.")
    use_beam_search: bool | None = Field(False, description="vLLM's: beam search, n (1 to 8) the beam width; the n choices are the best sequences, best first, by cumulative log-probability divided by length ** length_penalty (the length counts the prompt). Beams rank by the model's raw log-probabilities: temperature, top_p, top_k, min_p and seed change nothing (as vLLM). A beam ends on EOS (unless ignore_eos), on stop_token_ids, or at max_tokens, never before min_tokens. Not with stop strings, penalties, logit_bias, bad_words, allowed_token_ids, a structured output (tool_choice required or named included), repetition_detection, thinking_token_budget or a session; a stream sends each choice whole when the search ends. Not in OpenAI's API.")
    length_penalty: float | None = Field(None, allow_inf_nan=False, description="vLLM's, with use_beam_search: a sequence's score is its cumulative log-probability divided by its length to this power (default 1; 0 ranks by log-probability alone); without use_beam_search it does nothing (as vLLM). Not in OpenAI's API.")
    spaces_between_special_tokens: unsupported(bool | None, True) = Field(None, description="vLLM's; only true (its default) or null.")
    priority: unsupported(int | None, 0) = Field(None, description="vLLM's; only 0 or null: the scheduling priority comes from the API key's QoS class (tenants.yaml).")
    cache_salt: Text | None = Field(None, min_length=1, description="vLLM's: this request's KV blocks are cached under this string within the tenant's cache scope, reused only by requests that send the same string (a secret per end user keeps another user from probing its prompts through cache timing). Not in OpenAI's API.")

    @property
    def batched(self) -> bool:
        """The request holds a list of prompts (only completions can)."""
        return False

    @model_validator(mode="after")
    def _one_structure(self):
        if self.structured() is not None and self.min_tokens:
            raise FieldError("min_tokens", "min_tokens cannot be combined with a structured output (response_format or "
                             "structured_outputs): the grammar decides where the output may end")
        if self.stream and self.prompt_logprobs:
            raise FieldError("prompt_logprobs", "prompt_logprobs are not available when stream is true: send the request "
                             "without stream")
        if self.use_beam_search:
            self._beam_search_fits()
        return self

    def _beam_search_fits(self) -> None:
        """A beam search ranks whole sequences by the model's own log-probabilities: fields that
        change a token's score or forbid it are refused, named (temperature & co. change nothing)."""
        for name, neutral in BEAM_SEARCH_REFUSES.items():
            if getattr(self, name, None) not in neutral:
                raise FieldError(name, f"{name} cannot be combined with use_beam_search (beam search ranks "
                                 "whole sequences by the model's log-probabilities): leave it out")
        if self.structured() is not None:
            raise FieldError("use_beam_search", "use_beam_search cannot be combined with a structured output "
                             "(response_format, structured_outputs, tool_choice required or a named function)")

    def beam_params(self, max_tokens: int) -> dict | None:
        """The engine's ``BeamSearchParams`` fields (None: no beam search)."""
        if not self.use_beam_search:
            return None
        return {"beam_width": self.n, "max_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                "length_penalty": 1.0 if self.length_penalty is None else self.length_penalty,
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "stop_token_ids": list(self.stop_token_ids or ()), "min_tokens": self.min_tokens}

    def structured(self) -> dict | None:
        """The engine's ``structured_outputs`` (None: the output is free text)."""
        return structured_spec(self.response_format, self.structured_outputs)

    @field_validator("temperature", mode="after")
    @classmethod
    def _tiny_is_greedy(cls, value: float | None) -> float | None:
        return 0.0 if value is not None and value < GREEDY_BELOW else value

    def sampling_values(self, defaults: dict) -> dict:
        """The fields of :data:`SAMPLING_NEUTRAL` as the engine gets them: the request's
        value, else (unset or null) the server's default (``defaults``, the model's generation
        config, see ``model_info.sampling_defaults``), else the neutral value (as vLLM)."""
        return {name: value if (value := getattr(self, name)) is not None else defaults.get(name, neutral)
                for name, neutral in SAMPLING_NEUTRAL.items()}

    @field_validator("n", "stream", "min_tokens", "use_beam_search", mode="after")
    @classmethod
    def _null_is_the_default(cls, value, info):
        """An explicit null (SDKs send them) asks for the field's default."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("bad_words")
    @classmethod
    def _words_not_blank(cls, value):
        if any(not w.strip() for w in value or ()):
            raise ValueError("each bad word must have a character other than whitespace")
        return value

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return self.include_usage() and bool(self.stream_options.continuous_usage_stats)


PROMPT_SHAPES = ("a text, a list of token ids, or a batch (a list of texts, or a list of "
                 "token-id lists)")


def prompt_shape(value, max_prompts: int = MAX_PROMPTS):
    """One message for a prompt of the wrong shape, instead of one per union member; a batch
    holds at most ``max_prompts``."""
    def kind(v):
        if isinstance(v, str):
            return str
        if isinstance(v, int) or isinstance(v, float) and v.is_integer():   # 5.0 is JSON Schema's integer too
            return int
        return list if isinstance(v, list) and all(kind(x) is int for x in v) else None
    if isinstance(value, str):
        return value
    kinds = {kind(v) for v in value} if isinstance(value, list) else {None}
    if None in kinds or len(kinds) > 1:
        raise ValueError(f"must be {PROMPT_SHAPES}")
    if kinds != {int} and len(value) > max_prompts:
        raise ValueError(f"a batch may hold at most {max_prompts} prompts, got {len(value)}")
    for ids in [value] if kinds == {int} else value if kinds == {list} else []:
        if len(ids) > MAX_PROMPT_TOKEN_IDS:
            raise ValueError(f"a token-id prompt may have at most {MAX_PROMPT_TOKEN_IDS} ids, got {len(ids)}")
        if min(ids, default=0) < 0:
            raise ValueError(f"token ids are >= 0, got {min(ids)}")
    return value


Batch = Field(min_length=1, max_length=MAX_PROMPTS)
class CompletionRequest(_Common):
    prompt: Annotated[Text | list[TokenId] | Annotated[list[Text], Batch] | Annotated[list[list[TokenId]], Batch],
                      BeforeValidator(prompt_shape)] = Field(
        description=f"Text, a list of token ids (each in [0, vocabulary size), at most "
                    f"{MAX_PROMPT_TOKEN_IDS}), or a batch: a list of up to {MAX_PROMPTS} texts or of "
                    f"token-id lists. A batch answers n choices per prompt, in the order of the "
                    f"prompts (choice p x n + j is prompt p's j-th), at most {MAX_CHOICES} in all.")
    max_tokens: int | None = Field(None, ge=0, description="Most tokens to generate (>= 1; 0 with echo: only the prompt and, with logprobs, its scores, as vLLM). Default 16; null (vLLM's): the rest of the context, at most the generation config's max_new_tokens, else the tenant's max_tokens_per_request (256 when it sets none). Capped by the tenant's max_tokens_per_request.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=f"Return the log-probability of each generated token and of the this many most likely tokens (0 to {MAX_TOP_LOGPROBS}).")
    best_of: unsupported(int | None, 1) = Field(None, description="Not supported: only 1 or null.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (e.g. BOS) to a "
                                     "text prompt (vLLM's). Not in OpenAI's API.")
    echo: bool | None = Field(False, description="Put each prompt before its choices' text; with logprobs, "
                              "the prompt's tokens come first in the logprobs object, the first with a null "
                              "logprob (nothing precedes it), as vLLM answers. The prompt is computed in "
                              "full, not read from the prefix cache, when logprobs are asked.")
    suffix: unsupported(str | None, "") = Field(None, description="Not supported: only \"\" or null.")

    @model_validator(mode="after")
    def _few_choices(self):
        if self.batched and len(self.prompt) * self.n > MAX_CHOICES:
            raise FieldError("n", f"{len(self.prompt)} prompts x n={self.n} is {len(self.prompt) * self.n} "
                             f"choices; at most {MAX_CHOICES} per request: send fewer prompts or a lower n")
        return self

    @property
    def batched(self) -> bool:
        """The prompt is a list of prompts (texts or token-id lists)."""
        return isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or a batch."""
        return list(self.prompt) if self.batched else [self.prompt]


class TextPart(BaseModel):
    model_config = REQUEST_FIELDS
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: Text = Field(description="The text of this part.")


class ChatMessage(BaseModel):
    """One message. The fields OpenAI's SDK echoes back on an assistant message (``refusal``,
    ``audio``, ...) are accepted when null, so a reply can be appended to the history; an
    assistant message may carry the ``tool_calls`` an answer returned (its content then may be
    null), a ``tool`` message the ``tool_call_id`` it answers."""

    model_config = REQUEST_FIELDS
    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(description="Author role.")
    content: Text | list[TextPart] | None = Field(None, description="Text, or a list of {type: text, text} parts; null only on an assistant message with tool_calls or reasoning.")
    name: NullOnlyStr = Field(None, description="Not supported: only null.")
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS, description="An assistant message's function calls (as an answer returned them).")
    tool_call_id: str | None = Field(None, max_length=256, description="A tool message: the id of the call it answers.")
    function_call: NullOnlyDict = Field(None, description="Not supported: only null.")
    refusal: NullOnlyStr = Field(None, description="Only null.")
    audio: NullOnlyDict = Field(None, description="Not supported: only null.")
    annotations: EmptyList = Field(None, description="Only [] or null.")
    reasoning: Text | None = Field(None, description="An assistant message's reasoning, as an answer returned it (vLLM's); given to the chat template as reasoning and reasoning_content.")
    reasoning_content: Text | None = Field(None, description="The former name of reasoning (vLLM's, deprecated).")

    @model_validator(mode="after")
    def _content_or_calls(self):
        said = self.reasoning is not None or self.reasoning_content is not None
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or said)):
            raise ValueError("content is required (null only on an assistant message with tool_calls or reasoning)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as chat templates read it."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = template_calls(self.tool_calls)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if (said := self.reasoning if self.reasoning is not None else self.reasoning_content) is not None:
            out["reasoning"] = out["reasoning_content"] = said
        return out


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES, description=f"The conversation so far (1 to {MAX_MESSAGES} messages).")
    add_special_tokens: bool = Field(False, description="Add the tokenizer's special tokens (e.g. BOS) on top "
                                     "of what the chat template writes (vLLM's). Not in OpenAI's API.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Most tokens to generate (>= 1); the same as max_tokens (send one of them).")
    logprobs: bool | None = Field(False, description="Return the log-probability of each generated token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=f"With logprobs: also the this many most likely tokens at each position (0 to {MAX_TOP_LOGPROBS}).")
    parallel_tool_calls: bool | None = Field(None, description='false: at most one tool call ("required" is constrained to one, "auto" answers its first), as vLLM\'s.')
    safety_identifier: str | None = Field(None, description=_ignored("end-user id"))
    store: unsupported(bool | None, False) = Field(None, description="Not supported: only false or null.")
    metadata: unsupported(dict[str, str] | None, {}) = Field(None, description="Not supported: only {} or null.")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description=f"Functions the model may call (at most {MAX_TOOLS}); shown to the chat template.")
    tool_choice: ToolChoice | None = Field(None, validate_default=True, description='A named function ({"type": "function", "function": {"name"}}: the answer is its arguments), "required" (one or more calls of the tools) or "auto" (the default with tools: text or calls in the model\'s own format, with a server started with enable_auto_tool_choice and tool_call_parser), answered as message.tool_calls; "none": a text answer.')
    functions: EmptyList = Field(None, description="Not supported: only [] or null.")
    function_call: unsupported(str | dict | None, "none") = Field(None, description='Not supported: only "none" or null.')
    audio: NullOnlyDict = Field(None, description="Not supported: only null.")
    modalities: unsupported(list[str] | None, ["text"]) = Field(None, description='Only ["text"] or null.')
    prediction: NullOnlyDict = Field(None, description="Not supported: only null.")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(None, description="How hard a reasoning model thinks (vLLM's): given to the chat template as reasoning_effort, and \"none\" turns thinking off (enable_thinking false, unless chat_template_kwargs sets it).")
    include_reasoning: bool = Field(True, description="With a reasoning parser: false leaves the reasoning out of the answer, and with it the logprobs and token ids, which would spell it (vLLM's). Not in OpenAI's API.")
    verbosity: NullOnlyStr = Field(None, description="Not supported: only null.")
    web_search_options: NullOnlyDict = Field(None, description="Not supported: only null.")
    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant turn's opening (vLLM's). Not in OpenAI's API.")
    continue_final_message: bool = Field(False, description="The answer continues the last message, e.g. the start of an assistant reply, instead of opening a new turn (vLLM's; with add_generation_prompt false). Not in OpenAI's API.")
    echo: bool = Field(False, description="Each choice's content starts with the last message's text when that message has the answer's role (assistant; with add_generation_prompt false, any), e.g. a reply continued with continue_final_message (vLLM's). Not in OpenAI's API.")
    chat_template_kwargs: Annotated[dict, AfterValidator(template_kwargs)] | None = Field(None, max_length=32, description="Extra variables for the chat template, e.g. {\"enable_thinking\": false} (vLLM's; not the names the template is already given). Not in OpenAI's API.")

    @field_validator("tool_choice", mode="after")
    @classmethod
    def _servable(cls, value, info):
        tool_mode(info.data.get("tools"), value)
        return value

    def template_variables(self) -> dict:
        """The chat template's extra variables: ``chat_template_kwargs``, with
        ``reasoning_effort`` (and ``enable_thinking`` from it, unless set) as vLLM adds them."""
        asked = self.chat_template_kwargs or {}
        if self.reasoning_effort is None:
            return asked
        return {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none", **asked}

    def echo_text(self) -> str | None:
        """What ``echo`` puts before each choice's content (None: nothing)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return None
        return last.text() or None

    def tool_mode(self) -> str | None:
        """``"auto"``, ``"required"``, the named function, or None (a text answer): see
        ``tool_calls``."""
        return tool_mode(self.tools, self.tool_choice)

    def structured(self) -> dict | None:
        mode, asked = self.tool_mode(), super().structured()
        if mode in (None, "auto"):
            return asked
        if asked is not None:
            raise ValueError("tool calls (tool_choice) cannot be combined with response_format or structured_outputs")
        return constraint(self.tools, mode, one=self.parallel_tool_calls is False)

    def template_tools(self) -> list[dict] | None:
        return template_tools(self.tools)

    @model_validator(mode="after")
    def _one_length_limit(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise FieldError("max_completion_tokens", "max_tokens and max_completion_tokens differ: send only max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.continue_final_message and (self.add_generation_prompt or not self.messages[-1].text().strip()):
            raise FieldError("continue_final_message", "continue_final_message needs add_generation_prompt: false and a last message "
                             "with text to continue")
        return self


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's route): the token ids a generation route would compute."""

    model_config = REQUEST_FIELDS
    model: Text = Field(description="Model id, as listed by /v1/models.")
    prompt: Text | None = Field(None, description="A completions prompt (text).")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, max_length=MAX_MESSAGES,
        description=f"A chat (1 to {MAX_MESSAGES} messages), rendered with the model's chat template.")
    add_generation_prompt: bool = Field(True, description="With messages: end with the assistant "
                                        "turn's opening, as /v1/chat/completions does.")
    continue_final_message: bool = Field(False, description="With messages and add_generation_prompt false: "
                                         "end where the last message's text ends, as chat's does.")
    chat_template_kwargs: Annotated[dict, AfterValidator(template_kwargs)] | None = Field(None, max_length=32, description="With messages: extra variables for the chat template, as chat's.")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="With messages: the chat's tools, "
                                     "shown to the chat template as /v1/chat/completions shows them.")
    add_special_tokens: bool | None = Field(None, description="Add the tokenizer's special tokens (e.g. BOS), "
                                            "as the generation routes do (vLLM's; default: true for a "
                                            "prompt, false for messages).")

    def template_variables(self) -> dict:
        return self.chat_template_kwargs or {}

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (a text) or messages (a chat)")
        if self.tools and self.messages is None:
            raise FieldError("tools", "tools go with messages (a chat), not with a prompt")
        if self.continue_final_message and (self.add_generation_prompt or not self.messages):
            raise FieldError("continue_final_message", "continue_final_message needs messages and add_generation_prompt: false")
        return self

    def template_tools(self) -> list[dict] | None:
        return template_tools(self.tools)


class TokenizeResponse(BaseModel):
    count: int = Field(description="Number of tokens (the generation routes' prompt_tokens).")
    max_model_len: int = Field(description="Context length in tokens (prompt + completion).")
    tokens: list[int] = Field(description="The token ids.")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's route): the text of token ids."""

    model_config = REQUEST_FIELDS
    model: Text = Field(description="Model id, as listed by /v1/models.")
    tokens: list[TokenId] = Field(max_length=MAX_PROMPT_TOKEN_IDS,
                              description=f"Token ids (each in [0, vocabulary size), at most {MAX_PROMPT_TOKEN_IDS}).")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="The decoded text (special tokens included).")
