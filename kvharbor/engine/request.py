"""Sampling parameters, per-request engine state and outputs."""

from __future__ import annotations

import copy
import enum
import math
import numbers
import operator
from dataclasses import dataclass, field

from .block_pool import KVCacheBlock
from .hashing import BlockHash, hash_prompt_blocks
from .repetition import REASON as REPEATED, RepetitionDetectionParams
from .structured_output import StructuredOutputsParams


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0``, ``top_p == 1`` and ``min_p == 0`` disable
    those filters. ``seed`` makes sampling reproducible per request. The penalties,
    ``logit_bias`` and ``min_tokens`` change the logits before sampling, greedy included (see
    ``logits_processors.py``); their neutral values (0, 1 for ``repetition_penalty``, None)
    leave them untouched. ``structured_outputs`` constrains the output to a JSON schema, a
    regex, a choice or a grammar (``structured_output.py``; a dict of its fields is accepted).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0                 # stop ids and EOS are held back until this many tokens
    logprobs: int | None = None         # None: none; k: the sampled token's and the k best
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's and the k best
    min_p: float = 0.0                  # drop tokens below min_p x the most likely's probability
    presence_penalty: float = 0.0       # OpenAI's: subtracted once from tokens in the output
    frequency_penalty: float = 0.0      # OpenAI's: subtracted per occurrence in the output
    repetition_penalty: float = 1.0     # vLLM's: scales logits of tokens in the prompt or output
    logit_bias: dict[int, float] | None = None      # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | dict | None = None
    n: int = 1                          # LLM.generate: samples per prompt (RequestOutput.outputs)
    include_stop_str_in_output: bool = False    # vLLM's: the text keeps the stop string that ended it
    allowed_token_ids: list[int] | None = None  # vLLM's: only these ids may be generated
    bad_words: list[str] | None = None  # vLLM's: these words are never generated (bad_word_ids)
    truncate_prompt_tokens: int | None = None   # vLLM's: keep only the prompt's last k tokens
    skip_special_tokens: bool = True    # vLLM's: False keeps special tokens (e.g. EOS) in the text
    thinking_token_budget: int | None = None    # vLLM's: reasoning closed after this many tokens
    repetition_detection: RepetitionDetectionParams | dict | None = None   # vLLM's: a loop ends it

    def validate(self) -> None:
        """Raise ValueError naming the field to fix.

        Types are checked here too: a value the engine step cannot use (a float seed, a stop
        list of numbers) would otherwise fail that step for every request in the batch.
        """
        self.max_tokens = _integer("max_tokens", self.max_tokens, " >= 1")
        self.top_k = _integer("top_k", self.top_k, " >= 0 (0 disables it)")
        self.min_tokens = _integer("min_tokens", self.min_tokens, f" in [0, max_tokens={self.max_tokens}]")
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
        if self.thinking_token_budget is not None:
            budget = _integer("thinking_token_budget", self.thinking_token_budget, " >= 0, or -1 (no budget)")
            if budget < -1:
                raise ValueError(f"thinking_token_budget must be an integer >= 0, or -1 (no budget), got {budget}")
            self.thinking_token_budget = None if budget == -1 else budget
        if self.truncate_prompt_tokens is not None:
            k = self.truncate_prompt_tokens = _integer("truncate_prompt_tokens", self.truncate_prompt_tokens, " >= 1")
            if k < 1:
                raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, got {k}")
        self.n = _integer("n", self.n, f" in [1, {MAX_N}]")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if getattr(self, name) not in (True, False):    # "false" would be true
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
            setattr(self, name, bool(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            setattr(self, name, _number(name, getattr(self, name)))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < 1e-5:
            self.temperature = 0.0          # greedy (far below, logits / temperature overflow to inf)
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not (stop is None or isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(stop or ())
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple))):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = [_integer("stop_token_ids", t) for t in self.stop_token_ids or ()]
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                k = _integer(name, k, " in [0, 20]")
                if not 0 <= k <= 20:
                    raise ValueError(f"{name} must be an integer in [0, 20], got {k!r}")
                setattr(self, name, k)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        if self.logit_bias:
            try:
                self.logit_bias = {_bias_key(k): _number("logit_bias", v) for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError):
                raise ValueError("logit_bias maps token ids to numbers (an id is an integer or, as in "
                                 f"OpenAI's API, its decimal string), got {self.logit_bias!r}") from None
            if not all(-100 <= v <= 100 for v in self.logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must name at least one token (None allows all)")
        words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
        if not (words is None or isinstance(words, (list, tuple))
                and all(isinstance(w, str) and w.strip() for w in words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        self.bad_words = list(words) if words else None
        if self.repetition_detection is not None:
            self.repetition_detection = RepetitionDetectionParams.of(self.repetition_detection)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar "
                                 "decides where the output may end")

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``): changing it leaves these params as they are."""
        return copy.deepcopy(self)

    @property
    def penalized(self) -> bool:
        """Any penalty that depends on the tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def _integer(name: str, value, rule: str = "") -> int:
    """``value`` as an int (a numpy integer too); a float, a string or None is refused."""
    try:
        return int(operator.index(value))       # int(): True is 1, not a bool torch refuses as k
    except TypeError:
        raise ValueError(f"{name} must be an integer{rule}, got {value!r}") from None


def stopped_on_token(req: Request, token: int, text_before: int, eos_id: int | None) -> str:
    """``req`` ends on ``token``, an EOS id or one of its ``stop_token_ids`` (vLLM's rules): the
    token's text leaves the output unless ``include_stop_str_in_output``, and ``stop_reason`` is
    the id, but for the tokenizer's EOS (a generation config's other EOS ids are stop ids to
    vLLM)."""
    if not req.sampling.include_stop_str_in_output:
        req.output_text = req.output_text[:text_before]
    req.stop_reason = None if token == eos_id and not req.sampling.ignore_eos else token
    return "stop"


def repeated(req: Request) -> bool:
    """``req``'s output has fallen into a loop (``repetition_detection``, once ``min_tokens`` are
    out); sets its ``stop_reason`` (vLLM's)."""
    spec = req.sampling.repetition_detection
    if spec is None:                    # (every generated token asks: the common case first)
        return False
    n_out = req.num_output_tokens
    if n_out < req.sampling.min_tokens or not spec.found(req.all_token_ids, n_out):
        return False
    req.stop_reason = REPEATED
    return True


MAX_N = 256
"""Most samples per prompt (``SamplingParams.n``) one ``LLM.generate`` call takes."""


def sibling_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index``'s seed among ``n``: distinct per sample, reproducible, still a signed
    64-bit int (sample 0 keeps the caller's)."""
    if seed is None or index == 0:
        return seed
    return (seed + index + 2**63) % 2**64 - 2**63


def _bias_key(key) -> int:
    """A logit_bias key: a token id, or its decimal string (JSON keys are strings); 2.5 is refused,
    not truncated to token 2."""
    return int(key) if isinstance(key, str) else operator.index(key)


def bad_word_ids(tokenizer, words: list[str],
                 allowed: list[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell ``words``: each word alone and after a space, since a
    tokenizer may spell a word differently at the start of a text and inside it. Raises
    ValueError when they ban every one of the ``allowed`` ids (nothing could be picked)."""
    seqs = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    if allowed is not None and set(allowed) <= {seq[0] for seq in seqs if len(seq) == 1}:
        raise ValueError("bad_words ban every one of the allowed_token_ids; nothing could be generated")
    return tuple(seqs)


def check_request(prompt_token_ids, sampling: SamplingParams, tenant, qos, cache_salt, session_id,
                  qos_classes: dict, vocab_size: int, max_model_len: int,
                  request_salt: str | None = None, reasoning_parser: str | None = None) -> list[int]:
    """Check the arguments of ``Engine.add_request`` (``sampling`` is validated in place) and
    return the prompt's ids as ints. Raises ValueError naming the argument to fix."""
    sampling.validate()
    if sampling.thinking_token_budget is not None and reasoning_parser is None:
        raise ValueError("thinking_token_budget needs an engine with a reasoning_parser (the end of "
                         "the reasoning, which a spent budget forces, is the parser's)")
    if sampling.n != 1:
        raise ValueError(f"n={sampling.n}: an engine request is one sample; add one request per "
                         "sample with its own seed (LLM.generate does)")
    prompt = token_ids("prompt", prompt_token_ids)
    if sampling.truncate_prompt_tokens:
        prompt = prompt[-sampling.truncate_prompt_tokens:]
    for name, value in (("tenant", tenant), ("session_id", session_id), ("cache_salt", cache_salt),
                        ("request_salt", request_salt)):
        if not (value is None and name != "tenant" or isinstance(value, str) and value):
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if not isinstance(qos, str) or qos not in qos_classes:
        raise ValueError(f"unknown QoS class {qos!r}; known: {sorted(qos_classes)}")
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    for name, ids in (("prompt", prompt), ("stop_token_ids", sampling.stop_token_ids),
                      ("logit_bias", sampling.logit_bias or ()),
                      ("allowed_token_ids", sampling.allowed_token_ids or ())):
        if not 0 <= min(ids, default=0) <= max(ids, default=0) < vocab_size:
            raise ValueError(f"{name} token ids must be in [0, {vocab_size})")
    total = len(prompt) + sampling.max_tokens
    if total > max_model_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) = "
                         f"{total} exceeds the model's context of {max_model_len} tokens; "
                         f"shorten the prompt or lower max_tokens")
    return prompt


def token_ids(name: str, ids) -> list[int]:
    """``ids`` as a list of ints (numpy integers too); a float, string, bytes or None is refused,
    where ``int()`` would truncate 4.5 to token 4 or read "4" as token 4."""
    if isinstance(ids, (str, bytes, bytearray, dict)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{name} must be a list of token ids (integers), got {type(ids).__name__}")
    if type(ids) is list and all(type(t) is int for t in ids):
        return list(ids)
    out = []
    for t in ids:
        try:
            out.append(int(operator.index(t)))
        except TypeError:
            raise ValueError(f"{name} must be a list of token ids (integers), got {t!r} in it") from None
    return out


def is_index(value) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _number(name: str, value) -> float:
    if isinstance(value, numbers.Real):
        return float(value)
    raise ValueError(f"{name} must be a number, got {value!r}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class SwapState:
    """A swapped-out request's KV in host memory.

    ``slots[i]`` holds block ``i`` of the request (None: the block was the null block, released
    by the sliding window); together they cover the first ``num_tokens`` tokens.
    """

    slots: list
    num_tokens: int


@dataclass(slots=True, eq=False)
class Request:
    """Engine-side state of one request. ``all_token_ids`` = prompt + generated so far."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    tenant: str = "default"
    qos: str = "standard"
    priority: int = 0
    pinned: bool = False
    cache_salt: str | None = None        # the hashing salt: scope + the request's own + adapter
    scope: str | None = None             # the tenant's cache scope, what a scope flush matches
    hash_root: BlockHash | None = None   # the model's chain root (hashing.model_root)
    session_id: str | None = None        # the turn of this session (sessions.py); None: no session
    arrival: float = 0.0
    arrival_seq: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1          # prefix-hit tokens at first schedule (-1: not yet)
    block_hashes: list[BlockHash] = field(default_factory=list)
    blocks: list[KVCacheBlock] = field(default_factory=list)
    window_start: int = 0                # blocks before this index were released (sliding window)
    swap: SwapState | None = None        # set while swapped out to host memory
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it
    output_text: str = ""
    num_preemptions: int = 0
    first_token_time: float | None = None
    generator: object = None             # torch.Generator when seeded
    rng_states: list = field(default_factory=list)   # its state before each draft's row (sampling.py)
    cached_blocks_cursor: int = 0        # blocks [0, cursor) were registered in the prefix cache
    held_stops: tuple[int, ...] = ()     # ids masked until min_tokens (stop ids, EOS unless ignored)
    bad_words: tuple[tuple[int, ...], ...] = ()   # bad_words' token sequences (bad_word_ids)
    allowed: object = None               # allowed_token_ids as a bool mask [V] (logits_processors)
    allowed_ids: frozenset | None = None  # allowed_token_ids as a set (Engine._finish_reason)
    prompt_lps: list | None = None       # prompt_logprobs asked: TokenLogprobs per prompt token so far
    matcher: object = None               # structured_outputs: its xgrammar GrammarMatcher
    grammar_wait: object = None          # the matcher held back while the model reasons (until </think>)
    reasoning: bool = False              # with a reasoning parser: the model is still thinking
    reasoning_tokens: int = 0            # its output tokens until the one that closed </think>
    think_end: tuple[int, ...] = ()      # thinking_token_budget: the ids of </think>, forced when spent
    forced_ids: list[int] = field(default_factory=list)   # ids its next tokens must be, in order
    lora: object = None                  # the LoRAAdapter it generates with (None: the base model)
    spec_token_ids: list[int] = field(default_factory=list)   # draft tokens this step verifies (spec_decode.py)
    spec: object = None                  # its NgramIndex (speculative decoding drafts from it)
    pooling: object = None               # an embedding request's PoolingParams (pooling.py); None: it generates

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (``len(output_token_ids)`` without the copy)."""
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def output_ids(self) -> OutputIds:
        """``output_token_ids`` as they are now, without copying them (``RequestOutput``)."""
        return OutputIds(self.all_token_ids, len(self.prompt_token_ids), len(self.all_token_ids))

    @property
    def prompt_lps_missing(self) -> bool:
        """Asked for prompt logprobs and some are not computed yet (its prompt must be run,
        not read from the prefix cache, from the first missing one on)."""
        return self.prompt_lps is not None and len(self.prompt_lps) < len(self.prompt_token_ids)

    def update_block_hashes(self, block_size: int) -> None:
        """Extend ``block_hashes`` to cover every full block of ``all_token_ids``."""
        start = len(self.block_hashes)
        parent = self.block_hashes[-1] if start else self.hash_root
        self.block_hashes += hash_prompt_blocks(self.all_token_ids, block_size, self.cache_salt,
                                                start=start, parent=parent)


class RequestOutput:
    """What ``generate`` returns, and what ``Engine.step`` streams (``new_token_ids`` is the delta).

    ``token_ids`` and ``text`` are cumulative. The engine hands each step's output the
    request's id list and how far it reached (``Request.output_ids``), and ``token_ids`` slices
    it when first read: a stream that reads only the deltas pays nothing per token for the
    whole output (the list only grows, so the slice is what it held at that step).
    """

    __slots__ = ("request_id", "prompt_token_ids", "_token_ids", "text", "finish_reason",
                 "num_cached_tokens", "new_token_ids", "new_text", "new_logprobs", "prompt_logprobs",
                 "logprobs", "_outputs", "prompt", "num_reasoning_tokens", "stop_reason")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 token_ids: list[int] | OutputIds, text: str, finish_reason: str | None,
                 num_cached_tokens: int, new_token_ids: list[int] | None = None,
                 new_text: str = "", new_logprobs: list | None = None,
                 prompt_logprobs: list | None = None, logprobs: list | None = None,
                 outputs: list[CompletionOutput] | None = None, prompt: str | None = None,
                 num_reasoning_tokens: int = 0, stop_reason: int | str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._token_ids = token_ids
        self.text = text
        self.finish_reason = finish_reason
        self.num_cached_tokens = num_cached_tokens
        self.new_token_ids = [] if new_token_ids is None else new_token_ids
        self.new_text = new_text
        self.new_logprobs = new_logprobs        # TokenLogprobs per new token, when asked for
        self.prompt_logprobs = prompt_logprobs  # prompt_logprobs asked: None, then TokenLogprobs per prompt token
        self.logprobs = logprobs                # LLM.generate, logprobs asked: TokenLogprobs per token_ids entry
        self._outputs = outputs                 # LLM.generate with n > 1: every sample
        self.prompt = prompt                    # LLM.generate: the prompt's text (None: given as ids)
        self.num_reasoning_tokens = num_reasoning_tokens   # with a reasoning parser: tokens until </think>
        self.stop_reason = stop_reason          # vLLM's: the stop token id or stop string that ended it

    @property
    def token_ids(self) -> list[int]:
        ids = self._token_ids
        if type(ids) is OutputIds:
            ids = self._token_ids = ids.ids[ids.start:ids.stop]
        return ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids = value

    @property
    def num_output_tokens(self) -> int:
        """``len(token_ids)``, without slicing them."""
        ids = self._token_ids
        return ids.stop - ids.start if type(ids) is OutputIds else len(ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The prompt's samples, as vLLM's ``RequestOutput.outputs``: ``SamplingParams.n`` of
        them from ``LLM.generate``; otherwise this output's own text and tokens as sample 0 (the
        fields above are sample 0's)."""
        if self._outputs is None:
            return [CompletionOutput.of(0, self)]
        return self._outputs

    @outputs.setter
    def outputs(self, value: list[CompletionOutput]) -> None:
        self._outputs = value

    def _fields(self) -> tuple:
        return (self.request_id, self.prompt_token_ids, self.token_ids, self.text,
                self.finish_reason, self.num_cached_tokens, self.new_token_ids, self.new_text,
                self.new_logprobs, self.prompt_logprobs, self.logprobs, self._outputs, self.prompt,
                self.num_reasoning_tokens, self.stop_reason)

    def __eq__(self, other: object) -> bool:
        if type(other) is not RequestOutput:
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None

    def __reduce__(self):
        return RequestOutput, self._fields()

    def __repr__(self) -> str:
        names = ("request_id", "prompt_token_ids", "token_ids", "text", "finish_reason",
                 "num_cached_tokens", "new_token_ids", "new_text", "new_logprobs", "prompt_logprobs",
                 "logprobs", "outputs", "prompt", "num_reasoning_tokens", "stop_reason")
        return "RequestOutput(" + ", ".join(f"{n}={v!r}" for n, v in zip(names, self._fields())) + ")"


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt (vLLM's ``CompletionOutput``): ``RequestOutput.outputs[index]``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None        # TokenLogprobs per token, when asked for
    cumulative_logprob: float | None = None     # sum of the sampled tokens' logprobs, when asked for
    stop_reason: int | str | None = None        # the stop token id or stop string that ended it

    @classmethod
    def of(cls, index: int, out: RequestOutput) -> CompletionOutput:
        lps = out.logprobs
        return cls(index, out.text, out.token_ids, out.finish_reason, lps,
                   None if lps is None else sum(lp.logprob for lp in lps), out.stop_reason)


@dataclass(slots=True)
class OutputIds:
    """``ids[start:stop]``, not yet sliced (``ids`` only grows: see ``RequestOutput``).
    Not frozen: a frozen dataclass's constructor costs twice as much, once per token."""

    ids: list[int]
    start: int
    stop: int
