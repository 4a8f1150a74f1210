"""OpenAI-compatible response bodies, as the OpenAPI schema documents them (the handlers
build plain dicts, see ``generation``; ``openai_protocol`` re-exports these names)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from .tool_calls import ToolCall


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="Tokens the model spent thinking, until the one that closed </think>.")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens in the prompt.")
    completion_tokens: int = Field(description="Tokens generated.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")
    prompt_tokens_details: PromptTokensDetails = Field(description="Prefix-cache hits.")
    completion_tokens_details: CompletionTokensDetails | None = Field(None, description="Chat, with a reasoning parser (vLLM's).")


SERVICE_TIER = Field("default", description="\"flex\": the request ran below its key's QoS class "
                     "(it asked service_tier \"flex\"); \"default\": at its key's class.")


class KvharborInfo(BaseModel):
    replica_id: str | None = Field(description="The LLM replica that served the request.")
    timings_ms: dict[str, float] | None = Field(
        None, description="Where the time to first token went, in ms: proxy (Serve's proxy -> "
                          "the gateway, behind Serve's proxy only), parse (reading and validating "
                          "the body), queue (class-queue place), "
                          "tokenize, admit (tenant limits), first_token (admitted -> first token), "
                          "replica (the replica's share of first_token), hops (router and Ray calls). "
                          "On the response, or the usage chunk of a stream.")
    transport: str | None = Field(
        None, description="How the replica's tokens reached the gateway: 'direct' (a connection "
                          "of its own to the replica: pinned QoS classes, kvharbor.platform."
                          "direct_stream) or 'serve' (a Ray Serve handle call). With timings_ms.")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(description="Each generated token's text.")
    token_logprobs: list[float | None] = Field(description="Natural-log probability of each token (the model's raw distribution); null for an echoed prompt's first token.")
    top_logprobs: list[dict[str, float] | None] = Field(description="The `logprobs` most likely tokens at each position and the chosen one (up to logprobs+1 entries, as OpenAI and vLLM answer); null for an echoed prompt's first token.")
    text_offset: list[int] = Field(description="Character offset of each token in the choice's text.")


class PromptLogprob(BaseModel):
    logprob: float = Field(description="Natural-log probability (-9999.0 for an impossible token, as vLLM).")
    rank: int = Field(description="Place in the vocabulary: 1 for the most likely token (a tie ranks it last).")
    decoded_token: str = Field(description="The token's text.")


STOP_REASON = ("vLLM's: the stop token id (of stop_token_ids) or the stop string (of stop) that ended "
               "the choice; null when something else did (the end-of-sequence token, max_tokens). On "
               "a stream, on each choice's last chunk.")
PROMPT_LOGPROBS = ("With prompt_logprobs (vLLM's; also completions' echo with logprobs): one entry per "
                   "prompt token, null for the first (nothing precedes it), else token id (as a string) "
                   "to its score: the prompt's token, then the prompt_logprobs most likely ones.")


class CompletionChoice(BaseModel):
    index: int = Field(description="Choice number, 0 to n - 1.")
    text: str = Field(description="Generated text.")
    logprobs: CompletionLogprobs | None = Field(None, description="With `logprobs` set: per-token log-probabilities.")
    finish_reason: str | None = Field(description="'stop', 'length', or 'abort' (stopped by the server).")
    stop_reason: int | str | None = Field(None, description=STOP_REASON)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, description=PROMPT_LOGPROBS)


class CompletionResponse(BaseModel):
    id: str = Field(description="Request id.")
    object: Literal["text_completion"] = Field(description="Object type.")
    created: int = Field(description="Unix seconds.")
    model: str = Field(description="Model id.")
    choices: list[CompletionChoice] = Field(description="n choices.")
    usage: Usage = Field(description="Token counts.")
    service_tier: Literal["default", "flex"] = SERVICE_TIER
    kvharbor: KvharborInfo = Field(description="Serving details.")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = Field(description="Always 'assistant'.")
    content: str | None = Field(description="Generated text; null when the answer is tool_calls.")
    tool_calls: list[ToolCall] | None = Field(None, description="With tool_choice required, a named function, or auto and the model's calls: the calls (their arguments as JSON text).")
    reasoning: str | None = Field(None, description="With a reasoning parser (server option reasoning_parser): what the model wrote inside <think>...</think> (vLLM's).")


class TopLogprob(BaseModel):
    token: str = Field(description="Token text.")
    logprob: float = Field(description="Natural-log probability.")
    bytes: list[int] = Field(description="UTF-8 bytes of the token text.")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="The `top_logprobs` most likely tokens here.")


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(description="One entry per generated token.")
    refusal: None = Field(None, description="Always null.")


class ChatChoice(BaseModel):
    index: int = Field(description="Choice number, 0 to n - 1.")
    message: AssistantMessage = Field(description="The answer.")
    logprobs: ChatLogprobs | None = Field(None, description="With `logprobs: true`: per-token log-probabilities.")
    finish_reason: str | None = Field(description="'stop', 'length', 'tool_calls' (tool_choice required), or 'abort' (stopped by the server).")
    stop_reason: int | str | None = Field(None, description=STOP_REASON)


class ChatResponse(BaseModel):
    id: str = Field(description="Request id.")
    object: Literal["chat.completion"] = Field(description="Object type.")
    created: int = Field(description="Unix seconds.")
    model: str = Field(description="Model id.")
    choices: list[ChatChoice] = Field(description="n choices.")
    usage: Usage = Field(description="Token counts.")
    service_tier: Literal["default", "flex"] = SERVICE_TIER
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, description=PROMPT_LOGPROBS)
    kvharbor: KvharborInfo = Field(description="Serving details.")


class ModelCard(BaseModel):
    id: str = Field(description="Model id.")
    object: Literal["model"] = Field(description="Object type.")
    created: int = Field(description="Unix seconds (0).")
    owned_by: str = Field(description="Owner.")
    max_model_len: int = Field(description="Context length in tokens.")
    root: str = Field(description="The checkpoint: the base model's id, or a LoRA adapter's directory.")
    parent: str | None = Field(None, description="A LoRA adapter's base model (null for the base model).")


class ModelList(BaseModel):
    object: Literal["list"] = Field(description="Object type.")
    data: list[ModelCard] = Field(description="Served models.")
