"""``LLM``: the offline API over the engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from kvharbor.config import EngineConfig

from .beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from .engine import Engine
from .lora import LoRARequest
from .pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from .model_info import NO_CHAT_TEMPLATE, chat_template_text, sampling_defaults
from .request import CompletionOutput, RequestOutput, SamplingParams, is_index, sibling_seed, token_ids
from .tokenizer import chat_token_ids, template_kwargs

Prompt = str | Sequence[int] | dict


class LLM:
    """Generate with a paged-KV engine in this process.

    >>> llm = LLM(model="kvharbor/tiny-llama", device="cpu")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0]

    Keyword arguments are :class:`kvharbor.config.EngineConfig` fields.
    """

    def __init__(self, model: str = "kvharbor/tiny-llama", **kwargs) -> None:
        config = EngineConfig(model=model, **kwargs)
        self._defaults = sampling_defaults(model, config.generation_config, config.override_generation_config)
        self.engine = Engine(config)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no ``sampling_params``: the
        neutral values, with the model's generation config's (``generation_config``,
        ``override_generation_config``) over them, as vLLM's."""
        return SamplingParams(**self._defaults)

    @property
    def hf_model(self):
        """The transformers model the engine runs (an oracle for tests)."""
        return self.engine.model

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The tokenizer (vLLM's name for ``tokenizer``)."""
        return self.engine.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids. A prompt is text, token ids, or vLLM's dict forms
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``, either with an optional
        ``"cache_salt"`` (see ``generate``); anything else is a ValueError."""
        if isinstance(prompt, dict):
            keys = prompt.keys() - {"cache_salt"}
            if len(keys) != 1 or not {"prompt", "prompt_token_ids"} >= keys:
                raise ValueError("a dict prompt is {'prompt': text} or {'prompt_token_ids': [ids]} "
                                 f"with an optional 'cache_salt', got keys {sorted(map(str, prompt))}")
            salt = prompt.get("cache_salt")
            if "cache_salt" in prompt and not (isinstance(salt, str) and salt):
                raise ValueError(f"a dict prompt's 'cache_salt' must be a non-empty string, got {salt!r}")
            (key,) = keys
            prompt = prompt[key]
            if key == "prompt" and not isinstance(prompt, str):
                raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return token_ids("prompt", prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 tenant: str = "default", qos: str = "standard",
                 cache_salt: str | None = None, session_id: str | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run all prompts together (continuous batching); outputs in prompt order.

        ``session_id``: the prompts are turns of that session of ``tenant``: after each, its
        prompt + output KV blocks stay referenced for the next turn (``LLM.end_session``).
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model), as in vLLM; an adapter is loaded from its ``lora_path`` on first use.
        With ``SamplingParams(logprobs=k)`` an output's ``logprobs`` holds each of its tokens'.
        With ``SamplingParams(n=k)`` each prompt's output holds k samples in ``outputs`` (as
        vLLM's; its own fields are sample 0's); with a seed, sample j's seed is derived from it.
        An output's ``prompt`` is its prompt's text (None for token ids). A dict prompt's
        ``"cache_salt"`` (vLLM's): its blocks are reused only by prompts with the same salt
        (within ``cache_salt``, the tenant's cache scope). ``use_tqdm``: a
        progress bar of finished requests on stderr (vLLM shows one by default; kvharbor does not).
        """
        prompts = _prompt_list(prompts)
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if not (isinstance(params, Sequence) and all(isinstance(p, SamplingParams) for p in params)):
            raise ValueError("sampling_params must be a SamplingParams or a list of them, one per "
                             f"prompt; got {type(params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        loras = self._loras(lora_request, len(prompts))
        ids, groups, logprobs = [], [], {}
        later: dict[str, list[tuple]] = {}  # sample 0's id -> the other samples' requests
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                sp = _copy(sp)
                sp.validate()
                prompt_ids = self.encode(prompt)
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                group = [f"offline-{next(self._ids)}" for _ in range(sp.n)]
                groups.append(group)
                for j, rid in enumerate(group):     # sample j: its own request and seed
                    one = _copy(sp)
                    one.n, one.seed = 1, sibling_seed(sp.seed, j)
                    one.prompt_logprobs = sp.prompt_logprobs if j == 0 else None
                    request = (rid, prompt_ids, one, dict(tenant=tenant, qos=qos, cache_salt=cache_salt,
                                                          session_id=None if j else session_id, lora=lora,
                                                          request_salt=salt))
                    if sp.logprobs is not None:
                        logprobs[rid] = []
                    if j == 0:
                        self._add(ids, request)
                    else:
                        later.setdefault(group[0], []).append(request)
            final: dict[str, RequestOutput] = {}
            total = sum(map(len, groups))
            bar = tqdm(total=total, desc="Processed prompts", disable=not use_tqdm)
            while len(final) < total:
                outs = self._step()
                for out in outs:
                    rid = out.request_id
                    if out.new_logprobs and rid in logprobs:
                        logprobs[rid] += out.new_logprobs
                    if out.finished:
                        out.logprobs = logprobs.get(rid)
                        final[rid] = out
                        bar.update(1)
                    if rid in later and (out.new_token_ids or out.finished):
                        for request in later.pop(rid):   # sample 0's prompt is cached now: the
                            self._add(ids, request)      # other samples hit it, as HTTP's n does
                if not outs and not self.engine.scheduler.running:
                    self._fail_if_stuck()
                    lost = [rid for rid in ids if rid not in final]
                    if lost and not self.engine.has_unfinished():
                        raise RuntimeError(f"requests {lost} ended without a final output (aborted "
                                           "outside this call?)")
            bar.close()
        except BaseException:
            for rid in ids:                 # a refused prompt, a failed step or an interrupt: none
                self.engine.abort(rid)      # of the call stays queued
            raise
        outs = [final[group[0]] for group in groups]
        for out, group, prompt in zip(outs, groups, prompts):
            out.prompt = prompt.get("prompt") if isinstance(prompt, dict) else \
                prompt if isinstance(prompt, str) else None
            if len(group) > 1:
                out.outputs = [CompletionOutput.of(j, final[rid]) for j, rid in enumerate(group)]
        return outs

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None, lora_request: LoRARequest | None = None,
              tenant: str = "default", qos: str = "standard", cache_salt: str | None = None,
              use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """Embed each prompt (vLLM's ``LLM.embed``): the final hidden state of its last token,
        unit length unless ``pooling_params.normalize`` is false (``pooling.py``); in prompt
        order. The prompts run together and with any generation, through the prefix cache.
        ``truncate_prompt_tokens``: keep each prompt's last ``k`` tokens."""
        prompts = _prompt_list(prompts)
        params = PoolingParams() if pooling_params is None else pooling_params
        sampling = SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=truncate_prompt_tokens)
        (lora,) = self._loras(lora_request, 1)
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm)
        try:
            for prompt in prompts:
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                self._add(ids, (f"embed-{next(self._ids)}", self.encode(prompt), _copy(sampling),
                                dict(tenant=tenant, qos=qos, cache_salt=cache_salt, lora=lora,
                                     request_salt=salt, pooling=params)))
            while len(final) < len(ids):
                outs = self._step()
                for out in outs:
                    final[out.request_id] = out
                    bar.update(1)
                if not outs and not self.engine.scheduler.running:
                    self._fail_if_stuck()
            bar.close()
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [EmbeddingRequestOutput(rid, EmbeddingOutput(final[rid].embedding.tolist()), final[rid].prompt_token_ids,
                                       num_cached_tokens=final[rid].num_cached_tokens) for rid in ids]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None,
                    tenant: str = "default", qos: str = "standard",
                    cache_salt: str | None = None) -> list[BeamSearchOutput]:
        """Beam search (vLLM's ``LLM.beam_search``; the rule is in ``beam_search``): each
        round runs every live beam of every prompt together as one-token requests that read
        the beams' prefixes from the prefix cache. One output per prompt, its
        ``params.beam_width`` best sequences best first; a sequence's ``tokens`` and ``text``
        hold the prompt's and the generated part (as vLLM's; special tokens left out of the
        text). ``concurrency_limit``: at most this many prompts are searched at a time."""
        prompts = _prompt_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and not (is_index(concurrency_limit) and concurrency_limit >= 1):
            raise ValueError(f"concurrency_limit must be an integer >= 1, got {concurrency_limit!r}")
        self._loras(lora_request, len(prompts))         # checks them, loads the new ones
        loras = lora_request if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        searches = [BeamSearch(self.encode(p), params, self.engine.eos_ids, self.engine.eos_id) for p in prompts]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        limit = concurrency_limit or max(1, len(prompts))
        bar = tqdm(total=len(prompts), desc="Beam search", disable=not use_tqdm)
        for start in range(0, len(prompts), limit):
            batch = range(start, min(start + limit, len(prompts)))
            while running := [i for i in batch if not searches[i].done]:
                asked = [(i, ids) for i in running for ids in searches[i].prompts()]
                outs = self.generate(
                    [{"prompt_token_ids": ids, **({"cache_salt": salts[i]} if salts[i] else {})} for i, ids in asked],
                    SamplingParams(max_tokens=1, temperature=0.0, logprobs=searches[running[0]].num_candidates),
                    tenant=tenant, qos=qos, cache_salt=cache_salt, lora_request=[loras[i] for i, _ in asked])
                tops = iter(out.logprobs[0].top for out in outs)
                for i in running:
                    searches[i].advance([next(tops) for _ in searches[i].beams])
            bar.update(len(batch))
        bar.close()
        outputs = [BeamSearchOutput(search.best()) for search in searches]
        for search, output in zip(searches, outputs):
            for seq in output.sequences:
                ids = seq.tokens[:search.num_prompt_tokens] + search.text_ids(seq)
                seq.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One engine step's outputs; a request that failed in it is a RuntimeError (the caller
        aborts the call's others)."""
        outs = self.engine.step()
        for rid, error in self.engine.take_failures().items():
            raise RuntimeError(f"request {rid} failed in an engine step: {error!r}") from error
        return outs

    def _add(self, ids: list[str], request: tuple) -> None:
        rid, prompt_ids, sampling, kwargs = request
        self.engine.add_request(rid, prompt_ids, sampling, **kwargs)
        ids.append(rid)

    def _loras(self, lora_request, n: int) -> list[str | None]:
        """Each prompt's adapter name, loading the adapters not loaded yet."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * n
        if not (isinstance(lora_request, Sequence) and not isinstance(lora_request, str)
                and all(lr is None or isinstance(lr, LoRARequest) for lr in lora_request)):
            raise ValueError("lora_request must be a LoRARequest, None, or a list of them (one per "
                             f"prompt), got {lora_request!r}")
        if len(lora_request) != n:
            raise ValueError(f"got {len(lora_request)} LoRA requests for {n} prompts")
        for lr in lora_request:
            if lr is not None:
                self.engine.add_lora(lr.lora_name, lr.lora_path)
        return [None if lr is None else lr.lora_name for lr in lora_request]

    def _fail_if_stuck(self) -> None:
        """Nothing ran: raise if a request can never fit (``generate`` aborts the call's others)."""
        failed = self.engine.reject_unfittable()
        if failed:
            raise ValueError(next(iter(failed.values())))

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None,
             tools: list[dict] | None = None, **kwargs) -> list[RequestOutput]:
        """A chat turn through the tokenizer's chat template. ``messages`` is one conversation
        (a list of messages) or a list of conversations, run together; as vLLM's ``chat``, the
        answer is a list of outputs, one per conversation. ``continue_final_message``: the
        answer continues each conversation's last message (with ``add_generation_prompt``
        false). ``chat_template_kwargs``: extra variables for the template (vLLM's, e.g.
        ``{"enable_thinking": False}``). ``chat_template``: a Jinja file's path or the template,
        for this call (vLLM's; None: the engine's). ``tools``: function definitions
        (``{"type": "function", "function": {...}}``) the template shows the model, as vLLM's;
        the answer is text (parse its calls as the model's format says). ``kwargs`` are
        ``generate``'s."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        template = chat_template_text(chat_template) or self.tokenizer.chat_template
        if template is None:
            raise ValueError(NO_CHAT_TEMPLATE)
        extra = template_kwargs(chat_template_kwargs)
        batch = bool(messages) and isinstance(messages[0], (list, tuple))
        conversations = messages if batch else [messages]
        prompts = []
        for conversation in conversations:
            if not (isinstance(conversation, (list, tuple))
                    and all(isinstance(m, dict) and "role" in m for m in conversation)):
                got = repr(conversation)[:200]
                raise ValueError("messages must be a conversation (a list of {'role': ..., 'content': "
                                 f"...}} dicts) or a list of conversations, got {got}")
            prompts.append(chat_token_ids(self.tokenizer, list(conversation), chat_template=template,
                                          tools=tools, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, **extra))
        return self.generate(prompts, sampling_params, **kwargs)

    def stats(self) -> dict:
        return self.engine.stats()

    def fork_session(self, source: str, target: str, tenant: str = "default") -> int:
        """Start session ``target`` from ``source``'s cached blocks (no recompute). Returns the
        blocks it holds; raises ValueError if ``source`` is unknown or ``target`` exists."""
        held = self.engine.fork_session(tenant, source, target)
        if held is None:
            raise ValueError(f"no session {source!r} of tenant {tenant!r}")
        return held

    def end_session(self, session_id: str, tenant: str = "default") -> bool:
        """End a session now (its blocks become evictable). False if it is unknown."""
        return self.engine.end_session(tenant, session_id) is not None

    def check_integrity(self) -> None:
        self.engine.check_integrity()


def _prompt_list(prompts) -> list:
    """``generate``'s prompts as a list: one prompt (text, a dict, token ids) or a list of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__len__"):
        raise ValueError("prompts must be a prompt (text, token ids, or a dict) or a list of them, "
                         f"got {type(prompts).__name__}")
    if len(prompts) and is_index(prompts[0]):
        return [prompts]                    # one prompt of token ids
    return list(prompts)


def _copy(sp: SamplingParams) -> SamplingParams:
    """Each request gets its own params (the engine may normalise them)."""
    return SamplingParams(**{f: getattr(sp, f) for f in sp.__slots__})
