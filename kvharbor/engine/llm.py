"""``LLM``: the offline API over the engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvharbor.config import EngineConfig

from .engine import Engine
from .lora import LoRARequest
from .request import RequestOutput, SamplingParams, is_index, token_ids

Prompt = str | Sequence[int] | dict


class LLM:
    """Generate with a paged-KV engine in this process.

    >>> llm = LLM(model="kvharbor/tiny-llama", device="cpu")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0]

    Keyword arguments are :class:`kvharbor.config.EngineConfig` fields.
    """

    def __init__(self, model: str = "kvharbor/tiny-llama", **kwargs) -> None:
        self.engine = Engine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def hf_model(self):
        """The transformers model the engine runs (an oracle for tests)."""
        return self.engine.model

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids. A prompt is text, token ids, or vLLM's dict forms
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``; anything else is a ValueError."""
        if isinstance(prompt, dict):
            if len(prompt) != 1 or not {"prompt", "prompt_token_ids"} >= prompt.keys():
                raise ValueError("a dict prompt is {'prompt': text} or {'prompt_token_ids': [ids]}, "
                                 f"got keys {sorted(map(str, prompt))}")
            (key, prompt), = prompt.items()
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
                 ) -> list[RequestOutput]:
        """Run all prompts together (continuous batching); outputs in prompt order.

        ``session_id``: the prompts are turns of that session of ``tenant``: after each, its
        prompt + output KV blocks stay referenced for the next turn (``LLM.end_session``).
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model), as in vLLM; an adapter is loaded from its ``lora_path`` on first use.
        With ``SamplingParams(logprobs=k)`` an output's ``logprobs`` holds each of its tokens'.
        """
        prompts = _prompt_list(prompts)
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if not (isinstance(params, Sequence) and all(isinstance(p, SamplingParams) for p in params)):
            raise ValueError("sampling_params must be a SamplingParams or a list of them, one per "
                             f"prompt; got {type(params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        loras = self._loras(lora_request, len(prompts))
        ids = []
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, self.encode(prompt), _copy(sp), tenant=tenant, qos=qos,
                                        cache_salt=cache_salt, session_id=session_id, lora=lora)
                ids.append(rid)
        except BaseException:
            for rid in ids:                 # a refused prompt refuses the call: none of it runs
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        logprobs = {rid: [] for rid, sp in zip(ids, params) if sp.logprobs is not None}
        while len(final) < len(ids):
            outs = self.engine.step()
            for out in outs:
                if out.new_logprobs and out.request_id in logprobs:
                    logprobs[out.request_id] += out.new_logprobs
                if out.finished:
                    out.logprobs = logprobs.get(out.request_id)
                    final[out.request_id] = out
            if not outs and not self.engine.scheduler.running:
                self._fail_if_stuck(ids, final)
        return [final[i] for i in ids]

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

    def _fail_if_stuck(self, ids: list[str], final: dict) -> None:
        """Nothing ran: raise (after aborting this call's requests) if one can never fit."""
        failed = self.engine.reject_unfittable()
        if failed:
            for rid in ids:
                self.engine.abort(rid)
            raise ValueError(next(iter(failed.values())))

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             **kwargs) -> RequestOutput:
        """One chat turn through the tokenizer's chat template."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return self.generate([list(ids)], sampling_params, **kwargs)[0]

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
