"""Incremental detokenization with stop strings.

Text is re-decoded from the output ids and a delta is released only up to the last complete
character, holding back as many characters as a stop string could still need, so a stream
never shows a replacement character or the start of a stop string it later removes.
"""

from __future__ import annotations

from .request import Request

_REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._sent: dict[str, int] = {}

    def update(self, req: Request) -> None:
        """Re-decode ``req.output_text`` from its output ids."""
        req.output_text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)

    def truncate_at_stop(self, req: Request, stops: list[str]) -> bool:
        """Cut ``req.output_text`` before the first stop string; True if one occurred."""
        cut = min((i for i in (req.output_text.find(s) for s in stops if s) if i >= 0), default=-1)
        if cut < 0:
            return False
        req.output_text = req.output_text[:cut]
        return True

    def delta(self, req: Request, final: bool) -> str:
        """Text not streamed before; on ``final`` all of it, and the request is forgotten."""
        sent = self._sent.get(req.request_id, 0)
        text = req.output_text
        if final:
            self._sent.pop(req.request_id, None)
            return text[sent:]
        holdback = max((len(s) for s in req.sampling.stop), default=1) - 1
        stable = len(text.rstrip(_REPLACEMENT)) - holdback
        if stable <= sent:
            return ""
        self._sent[req.request_id] = stable
        return text[sent:stable]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
