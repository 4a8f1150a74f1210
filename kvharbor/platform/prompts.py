"""A generation request's prompts as token ids, checked against the served model before it is
admitted: tokenizing, the chat template (with the tenant's ``context_overflow``), token ids
within the vocabulary, ``max_tokens`` within the context, the text ``echo`` puts first. Each
problem is an ``APIError`` 400 naming the field to fix."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kvharbor.engine.model_info import NO_CHAT_TEMPLATE
from kvharbor.engine.request import bad_word_ids
from kvharbor.engine.tokenizer import chat_token_ids
from kvharbor.platform.context_overflow import truncate_oldest
from kvharbor.platform.error_body import APIError
from kvharbor.platform.openai_protocol import ChatRequest, CompletionRequest


TOKENIZE_ON_LOOP_BYTES = 64 * 1024
"""Request bodies up to this size are tokenized on the gateway's event loop (a short prompt
takes ~0.1 ms); larger ones, or bodies of unknown size, on the tokenizer thread. Tokenizing a
prompt near the 4 MiB body limit took 3.5-4.9 s here, and on the loop it held up every other
tenant's request to that gateway for that long. HF's fast tokenizers release the GIL while
they encode, and one thread keeps such prompts to one core."""


class Prompts:
    """The prompt side of the gateway for one model (its tokenizer and context length)."""

    def __init__(self, tokenizer, context: int, defaults: dict | None = None) -> None:
        self.tokenizer, self.context = tokenizer, context
        self.defaults = defaults or {}   # the model's default sampling (model_info.sampling_defaults)
        self._thread = ThreadPoolExecutor(1, "kvharbor-tokenize")     # large bodies only

    async def off_loop(self, tokenize, size: int | None):
        """``tokenize()``: on the loop for a body of ``size`` bytes up to
        ``TOKENIZE_ON_LOOP_BYTES``, else on the tokenizer thread, so that the loop serves
        other requests meanwhile."""
        if size is not None and size <= TOKENIZE_ON_LOOP_BYTES:
            return tokenize()
        return await asyncio.get_running_loop().run_in_executor(self._thread, tokenize)

    def check_token_ids(self, ids: list[int], where: str) -> None:
        vocab = len(self.tokenizer)
        if not 0 <= min(ids, default=0) <= max(ids, default=0) < vocab:
            raise APIError(400, f"{where} token ids must be in [0, {vocab})", param=where)

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def completion_ids(self, body: CompletionRequest) -> list[list[int]]:
        """The token ids of each prompt (one, or each of a batch)."""
        names = [f"prompt.{p}" if body.batched else "prompt" for p in range(len(body.prompts()))]
        return self.ids_of(list(zip(names, body.prompts())), body.add_special_tokens)

    def ids_of(self, named: list[tuple[str, str | list[int]]], add_special_tokens: bool) -> list[list[int]]:
        """The token ids of each ``(name, text or token ids)``; ids outside the vocabulary are a
        400 naming their input."""
        out = []
        for name, given in named:
            if isinstance(given, str):
                out.append(self.text_ids(given, add_special_tokens))
            else:
                self.check_token_ids(given, name)
                out.append(list(given))
        return out

    def check_lengths(self, names: list[str], prompts: list[list[int]], fix: str = "shorten the prompt") -> None:
        """A 400 naming the first prompt with no token or no room in the context (``fix``: what
        the message asks for)."""
        for name, ids in zip(names, prompts):
            if not ids:
                raise APIError(400, f"{name} must contain at least one token", param=name)
            if len(ids) >= self.context:
                raise APIError(400, f"{name} is {len(ids)} tokens; the model's context is {self.context} "
                               f"tokens: {fix}", "context_length_exceeded", name)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, continue_final_message: bool = False,
               template_kwargs: dict | None = None, add_special_tokens: bool = False) -> list[int]:
        """``messages`` (and ``tools``, and ``template_kwargs``' variables) through the model's
        chat template, as token ids; with ``continue_final_message``, cut where the last
        message's text ends; with ``add_special_tokens``, the rendered text is tokenized with the
        tokenizer's special tokens added (vLLM's: on top of those the template writes)."""
        if self.tokenizer.chat_template is None:
            raise APIError(400, NO_CHAT_TEMPLATE, param="messages")
        try:
            options = dict(add_generation_prompt=add_generation_prompt, tools=tools,
                           continue_final_message=continue_final_message, **(template_kwargs or {}))
            if add_special_tokens:
                return self.text_ids(self.tokenizer.apply_chat_template(messages, tokenize=False, **options))
            return chat_token_ids(self.tokenizer, messages, **options)
        except Exception as e:      # the caller's variables broke the template: their error, a 400
            if not template_kwargs:
                raise
            raise APIError(400, f"the chat template failed with these chat_template_kwargs: {e}",
                           param="chat_template_kwargs") from None

    def chat_ids(self, body) -> list[int]:
        """The token ids of a chat as /tokenize counts them: its messages and tools through the
        chat template (``add_generation_prompt`` as asked), nothing dropped."""
        return self.render([m.for_template() for m in body.messages], body.add_generation_prompt,
                           body.template_tools(), body.continue_final_message, body.template_variables(),
                           bool(body.add_special_tokens))

    def tokenize_ids(self, body) -> list[int]:
        """``/tokenize``: a prompt's ids (special tokens added unless ``add_special_tokens`` is
        false) or a chat's (:meth:`chat_ids`; added only when it is true), as the generation
        routes compute them by default."""
        if body.messages is None:
            return self.text_ids(body.prompt, body.add_special_tokens is not False)
        return self.chat_ids(body)

    def fit_chat(self, body: ChatRequest, principal, oldest: bool = False):
        """The chat's prompt, with the oldest turns dropped when the tenant's
        ``context_overflow`` is ``truncate_oldest`` (or the request asks it: ``oldest``) and it
        would not fit (``context_overflow``)."""
        messages, tools = [m.for_template() for m in body.messages], body.template_tools()
        want = body.max_tokens or self.default_max_tokens(True, principal)
        oldest = oldest or principal.config.context_overflow == "truncate_oldest"
        limit = self.context - want if oldest else 10**12
        return truncate_oldest(messages, lambda msgs: self.render(
            msgs, body.add_generation_prompt, tools, body.continue_final_message,
            body.template_variables(), body.add_special_tokens), limit)

    def truncate(self, body, prompts: list[list[int]]) -> list[list[int]]:
        """vLLM's ``truncate_prompt_tokens``: each prompt's last ``k`` tokens (its first ``k``
        with ``truncation_side`` "right"); -1: as many as the context holds with room for one
        generated token (vLLM's)."""
        k = body.truncate_prompt_tokens
        if k is None:
            return prompts
        k = self.context - 1 if k == -1 else k
        return [ids[:k] if body.truncation_side == "right" else ids[-k:] for ids in prompts]

    def echo_texts(self, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """The text ``echo`` puts before each prompt's choices: the prompt as sent, or its
        token ids decoded (as vLLM echoes them; also a text cut by ``truncate_prompt_tokens``)."""
        return [p if isinstance(p, str) and not body.truncate_prompt_tokens
                else self.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)
                for p, ids in zip(body.prompts(), prompts)]

    def limits(self, body, prompts: list[list[int]], chat: bool, principal) -> tuple[int, bool]:
        """``(max_tokens, prompt_only)`` for the engine, after every check of the prompts and
        the sampling fields that name token ids. ``prompt_only``: vLLM's echo of the prompt
        alone (``echo`` with ``max_tokens: 0``), for which the engine computes one token that
        the answer leaves out."""
        prompt_only = not chat and body.echo and body.max_tokens == 0
        max_tokens = self._max_tokens(body, prompts, chat, principal, prompt_only)
        self.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        self.check_token_ids(list(body.logit_bias or ()), "logit_bias")
        self.check_token_ids(body.allowed_token_ids or [], "allowed_token_ids")
        if body.bad_words:
            try:
                bad_word_ids(self.tokenizer, body.bad_words, body.allowed_token_ids)
            except ValueError as e:
                raise APIError(400, str(e), param="bad_words") from None
        answered = 0 if prompt_only else max_tokens
        if body.min_tokens > answered:
            raise APIError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens ({answered}); "
                           "lower min_tokens or raise max_tokens", param="min_tokens")
        return max_tokens, prompt_only

    def default_max_tokens(self, chat: bool, principal) -> int:
        """``max_tokens`` when a request gives none: 16 on completions (OpenAI's and vLLM's);
        on chat, or a completion's ``"max_tokens": null``, the generation config's
        ``max_new_tokens``, else the tenant's ``max_tokens_per_request`` (256 when it sets
        none); never above that cap. The caller also keeps it within the context."""
        cap = principal.limits.max_tokens_per_request or 256
        return min(self.defaults.get("max_tokens", cap) if chat else 16, cap)

    def _max_tokens(self, body, prompts: list[list[int]], chat: bool, principal, prompt_only: bool) -> int:
        """``max_tokens`` (or its default), checked against the longest prompt's room; 1 for
        ``prompt_only``."""
        names = [f"prompt.{p}" if body.batched else "prompt" for p in range(len(prompts))]
        self.check_lengths(names, prompts)
        name, ids = max(zip(names, prompts), key=lambda pair: len(pair[1]))
        room = self.context - len(ids)
        if prompt_only:
            return 1
        if body.max_tokens is None:          # an explicit null is vLLM's "the rest of the context"
            unbounded = chat or "max_tokens" in body.model_fields_set
            return max(1, min(room, self.default_max_tokens(unbounded, principal)))
        if body.max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1 (0 only with echo: true), got {body.max_tokens}",
                           param="max_tokens")
        if body.max_tokens > room:
            raise APIError(400, f"{name} ({len(ids)} tokens) + max_tokens ({body.max_tokens}) exceeds "
                           f"the model's context of {self.context} tokens; lower max_tokens to at most {room}",
                           "context_length_exceeded", "max_tokens")
        return body.max_tokens
