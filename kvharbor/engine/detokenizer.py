"""Incremental detokenization with stop strings.

Each new token decodes only a short window of ids (the tokens since the last *committed*
text plus the few before them, for context): the text a window adds over its own prefix is
committed once it ends in a complete character. ``req.output_text`` is the committed text plus
the still-incomplete tail, exactly what decoding all output ids at once gives, at a cost per
token that does not grow with the output. A delta is released only up to the last complete
character, holding back as many characters as a stop string could still need, so a stream
never shows a replacement character or the start of a stop string it later removes.
"""

from __future__ import annotations

from .request import Request

_REPLACEMENT = "\ufffd"


class _Cursor:
    """Per request: ids ``[prefix, read)`` were decoded as context; ``text`` is committed."""

    __slots__ = ("prefix", "read", "text")

    def __init__(self) -> None:
        self.prefix, self.read, self.text = 0, 0, ""


def _decoder(tokenizer, skip_special_tokens: bool):
    """``ids -> text``, without special tokens when ``skip_special_tokens``. For a fast
    tokenizer that does no clean-up this calls its Rust ``tokenizers.Tokenizer`` directly: what
    ``tokenizer.decode`` returns then, without the Python layers around it (two decodes per
    token per request were a third of a 64-request decode step's host time)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and \
            getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._sent: dict[str, int] = {}
        self._cursors: dict[str, _Cursor] = {}
        self._decode = _decoder(tokenizer, True)
        self._decode_special = _decoder(tokenizer, False)

    def update(self, req: Request) -> int:
        """Extend ``req.output_text`` by the text of the newest output ids (incrementally).
        Returns where the text may differ from before: the uncommitted tail is decoded again
        (0 when the window re-spelled its context and the whole output was decoded)."""
        cur = self._cursors.get(req.request_id)
        if cur is None:
            cur = self._cursors[req.request_id] = _Cursor()
        ids = req.all_token_ids
        base = len(req.prompt_token_ids)
        decode = self._decode if req.sampling.skip_special_tokens else self._decode_special
        changed = len(cur.text)
        context = decode(ids[base + cur.prefix:base + cur.read])
        window = decode(ids[base + cur.prefix:])
        tail = window[len(context):] if window.startswith(context) else None
        if tail is None:                 # the window re-spelled its context: decode in full
            cur.text = decode(ids[base:])
            cur.prefix = cur.read = len(ids) - base
            req.output_text = cur.text
            return 0
        if tail and not tail.endswith(_REPLACEMENT):
            cur.text += tail
            cur.prefix, cur.read, tail = cur.read, len(ids) - base, ""
        req.output_text = cur.text + tail
        return changed

    def truncate_at_stop(self, req: Request, stops: list[str], changed: int) -> str | None:
        """Cut ``req.output_text`` before the first stop string that ends at or after
        ``changed`` (after it with ``include_stop_str_in_output``); that stop string, or None.
        The search reads only the text from ``changed`` on and the ``len(stop) - 1``
        characters before it."""
        text, cut, end, found = req.output_text, -1, -1, None
        for stop in stops:
            at = text.find(stop, max(0, changed - len(stop) + 1)) if stop else -1
            if at >= 0 and (cut < 0 or at < cut):
                cut, end, found = at, at + len(stop), stop
        if found is not None:
            req.output_text = text[:end if req.sampling.include_stop_str_in_output else cut]
        return found

    def delta(self, req: Request, final: bool) -> str:
        """Text not streamed before; on ``final`` all of it, and the request is forgotten."""
        sent = self._sent.get(req.request_id, 0)
        text = req.output_text
        if final:
            self.forget(req.request_id)
            return text[sent:]
        holdback = max((len(s) for s in req.sampling.stop), default=1) - 1
        stable = len(text.rstrip(_REPLACEMENT)) - holdback
        if stable <= sent:
            return ""
        self._sent[req.request_id] = stable
        return text[sent:stable]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._cursors.pop(request_id, None)
