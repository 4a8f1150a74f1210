"""Structured outputs: a request's tokens constrained to a JSON schema, any JSON object, a
regular expression, one of a list of strings, or an EBNF grammar (vLLM's
``StructuredOutputsParams``), with xgrammar as vLLM's default backend does it.

A spec is compiled once against the model's tokenizer (``Grammars``, cached by spec); each
request gets its own ``GrammarMatcher``. Before a constrained row is sampled the matcher's
bitmask sets the logits of every token the grammar forbids to ``-inf``
(``logits_processors.apply``); the sampled token then advances the matcher, and the request
stops when the grammar is complete (``Engine._append_token``). ``max_tokens`` can still cut
an output short (finish reason ``length``), as in vLLM.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MAX_SPEC_CHARS = 65_536
"""Longest schema, regex, grammar or list of choices (as text) a request may send."""
KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_WHITESPACE = 20
"""Longest run of whitespace between two JSON tokens (a newline and four levels of four-space
indent fit): without a bound a model can emit whitespace until ``max_tokens``."""


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """What the output must match: exactly one of the five fields.

    ``json``: a JSON schema (a dict or its JSON text). ``regex``: a regular expression the
    whole output matches. ``choice``: the output is one of these strings. ``grammar``: an EBNF
    grammar in xgrammar's (GBNF-like) syntax whose start rule is ``root``. ``json_object``: any
    JSON object. JSON may have runs of up to ``MAX_WHITESPACE`` whitespace characters between
    its tokens; ``disable_any_whitespace``: compact JSON, no whitespace at all (vLLM's flag).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    @classmethod
    def of(cls, spec) -> StructuredOutputsParams:
        """``spec`` (an instance, or its fields as a dict) checked: one kind, text limits.
        Raises ValueError naming the field to fix."""
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {unknown}; known: {list(KINDS)} "
                                 "and disable_any_whitespace")
            spec = dict(spec)
            if isinstance(spec.get("choice"), list):
                spec["choice"] = tuple(spec["choice"])
            spec = cls(**spec)
        if not isinstance(spec, cls):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its fields")
        kinds = [k for k in KINDS if getattr(spec, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(kinds) or 'none'}")
        spec._check_kind(kinds[0])
        return spec

    def _check_kind(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        elif kind == "json_object":
            if value is not True:
                raise ValueError("structured_outputs.json_object must be true")
        elif not isinstance(value, str if kind != "json" else (str, dict)):
            raise ValueError(f"structured_outputs.{kind} must be {'a JSON schema' if kind == 'json' else 'a string'}")
        if len(self.source()) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} is longer than {MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def source(self) -> str:
        """The spec as one text: the cache key of its compiled grammar (with ``kind``)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict):
            return json.dumps(value)          # property order kept: it is the output's order
        if self.kind == "choice":
            return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return '{"type": "object"}' if self.kind == "json_object" else value   # as vLLM

    def grammar_of(self):
        """The tokenizer-independent ``xgrammar.Grammar`` (raises ValueError when it does not
        parse): what the gateway checks before a request is routed."""
        import xgrammar as xgr  # noqa: PLC0415  (a second of imports, only when used)

        return self._build(xgr.Grammar.from_json_schema, xgr.Grammar.from_regex, xgr.Grammar.from_ebnf)

    def _build(self, from_schema, from_regex, from_ebnf):
        """One of the three constructors (xgrammar's ``Grammar`` or ``GrammarCompiler``
        methods of those names) applied to the spec; its errors as ValueError."""
        kind, source = self.kind, self.source()
        try:
            if kind in ("json", "json_object"):
                if self.disable_any_whitespace:                 # compact JSON, as vLLM's flag
                    return from_schema(source, any_whitespace=False, separators=(",", ":"))
                return from_schema(source, max_whitespace_cnt=MAX_WHITESPACE)
            return (from_regex if kind == "regex" else from_ebnf)(source)
        except Exception as e:  # noqa: BLE001 - any failure to parse is the spec's to fix
            raise ValueError(f"structured_outputs.{kind} does not compile: {_message(e)}") from None


def _message(error: Exception) -> str:
    """xgrammar's message without its ``[time] /source/file.cc:line:`` prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())


class Grammars:
    """Compiled grammars of one model's tokenizer (thread-safe; compiled once per spec)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int], cache_bytes: int = 256 << 20):
        self._tokenizer, self._vocab, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._cache_bytes = cache_bytes
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams):
        """The ``CompiledGrammar`` of ``spec`` (from the compiler's cache after the first
        time). Raises ValueError when the spec does not compile."""
        c = self._get_compiler()
        return spec._build(c.compile_json_schema, c.compile_regex, c.compile_grammar)

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh ``GrammarMatcher`` for one request."""
        import xgrammar as xgr  # noqa: PLC0415

        return xgr.GrammarMatcher(self.compile(spec))

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr  # noqa: PLC0415

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab,
                                                          stop_token_ids=self._eos or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self._cache_bytes)
            return self._compiler


THINK_START, THINK_END = "<think>", "</think>"


def start_reasoning(req, tokenizer) -> None:
    """With a reasoning parser (vLLM's ``reasoning_parser``), ``req``'s answer starts in
    reasoning unless the prompt already closed it (its last think tag, in its last 64 tokens,
    is ``</think>``: Qwen3's template with thinking off). While it reasons its tokens are
    counted (``reasoning_tokens``) and its grammar waits: the model thinks freely, then its
    answer after ``</think>`` is constrained. With ``thinking_token_budget`` (vLLM's), once
    that many tokens were counted the next ones are forced to spell ``</think>``."""
    tail = tokenizer.decode(req.prompt_token_ids[-64:])
    if tail.rfind(THINK_END) <= tail.rfind(THINK_START):
        req.reasoning = True
        req.grammar_wait, req.matcher = req.matcher, None
        if req.sampling.thinking_token_budget is not None:
            req.think_end = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
            if req.sampling.thinking_token_budget == 0:
                req.forced_ids = list(req.think_end)


def advance(req, token: int, changed: int) -> str | None:
    """``req``'s matcher takes ``token``: "stop" when the grammar is complete (its EOS
    accepted), "abort" when the token is outside it (only non-finite logits could lead there).
    While ``req`` reasons, ``token`` is counted; once the text from ``changed`` on (what it
    changed) closes the reasoning, a grammar that waited constrains the next token."""
    if req.reasoning:
        req.reasoning_tokens += 1
        if req.forced_ids and token == req.forced_ids[0]:
            del req.forced_ids[0]
        if req.output_text.find(THINK_END, max(0, changed - len(THINK_END) + 1)) >= 0:
            req.reasoning = False
            req.matcher, req.grammar_wait = req.grammar_wait, None
        elif req.reasoning_tokens == req.sampling.thinking_token_budget:
            req.forced_ids = list(req.think_end)            # the budget is spent: close it
        return None
    if not req.matcher.accept_token(token):
        logger.warning("%s: token %d is outside its grammar; stopped", req.request_id, token)
        return "abort"
    return "stop" if req.matcher.is_terminated() else None


def mask(logits: torch.Tensor, matchers: dict) -> None:
    """Set ``logits`` ``[R, V]`` to ``-inf``, in place, where the matcher of row ``i``
    (``matchers[i]``) forbids the token; rows without a matcher are left as they are."""
    import xgrammar as xgr  # noqa: PLC0415

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, m in matchers.items():
        m.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=list(matchers))
