"""OpenAI response shapes for one generation: choices, chunks and ``logprobs`` objects.

Plain functions over plain dicts (the replica's token events); no I/O. ``finish_reason`` is
"stop", "length", or "abort" when the server stopped the request before it finished (the
value vLLM reports; it is never passed off as "stop").

``logprobs`` in a replica event: one ``(logprob, ((token id, logprob), ...))`` pair per new
token (natural log, the model's raw distribution, most likely alternative first).

The legacy completions API lists, at each position, the ``logprobs`` most likely tokens *and*
the chosen one ("up to logprobs+1 elements", OpenAI's reference; vLLM answers the same), so a
sampled token outside the top ones, or any token with ``logprobs: 0``, is still there. Chat's
``top_logprobs`` holds exactly the most likely ones: the chosen token has its own fields.
"""

from __future__ import annotations


class TokenText:
    """Token id -> the text of that token alone (cached; the tokenizer is the gateway's), or
    with ``as_ids`` (vLLM's ``return_tokens_as_token_ids``) the string ``token_id:<id>``, which
    names even a token whose text is no valid UTF-8 on its own."""

    def __init__(self, tokenizer, as_ids: bool = False) -> None:
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def completion_logprobs(event_lps, token_ids, text_of: TokenText, offset: int) -> dict:
    """The legacy completions ``logprobs`` object for the tokens of one event.

    ``offset`` is the character offset of the first token in the choice's text.
    """
    tokens = [text_of(t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in event_lps],
            "top_logprobs": [_with_chosen(top, t, lp, text_of)
                             for t, (lp, top) in zip(token_ids, event_lps)],
            "text_offset": offsets}


def _with_chosen(top, token_id: int, logprob: float, text_of: TokenText) -> dict[str, float]:
    """One position's completions ``top_logprobs``: the most likely tokens, then the chosen one
    if it is not among them."""
    best = {text_of(i): v for i, v in top}
    if all(i != token_id for i, _ in top):
        best.setdefault(text_of(token_id), logprob)
    return best


def prompt_logprobs(scored, token_ids, text_of: TokenText, k: int) -> dict:
    """The completions ``logprobs`` object of an echoed prompt, ``k`` alternatives a token:
    ``scored`` holds None for the first token (nothing precedes it) and ``(logprob, top, rank)``
    for each other, as vLLM answers."""
    part = completion_logprobs([], token_ids, text_of, 0)
    part["token_logprobs"] = [None if lp is None else lp[0] for lp in scored]
    part["top_logprobs"] = [None if lp is None else _with_chosen(lp[1][:k], t, lp[0], text_of)
                            for t, lp in zip(token_ids, scored)]
    return part


def vllm_prompt_logprobs(scored, token_ids, text_of: TokenText, k: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` field from the same ``scored``: per token, token id (a
    string) -> ``{"logprob", "rank", "decoded_token"}``, the prompt's token first, then the
    ``k`` most likely (the prompt's token keeps its place when it is one of them)."""
    def entry(logprob: float, rank: int, token_id: int) -> dict:
        return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": text_of.text(token_id)}
    out: list[dict | None] = []
    for t, lp in zip(token_ids, scored):
        if lp is None:
            out.append(None)
            continue
        logprob, top, rank = lp
        scores = {str(t): entry(logprob, rank, t)}
        scores.update((str(i), entry(v, r, i)) for r, (i, v) in enumerate(top[:k], start=1))
        out.append(scores)
    return out


def chat_logprobs(event_lps, token_ids, text_of: TokenText) -> dict:
    """The chat ``logprobs`` object (``{"content": [...], "refusal": None}``) of one event."""
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": text_of(token_id), "logprob": logprob, "bytes": list(text_of.text(token_id).encode("utf-8"))}
    content = [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
               for t, (lp, top) in zip(token_ids, event_lps)]
    return {"content": content, "refusal": None}


def merge_logprobs(parts: list[dict], chat: bool) -> dict | None:
    """One ``logprobs`` object from the per-event ones of a choice (None if there are none)."""
    if not parts:
        return None
    if chat:
        return {"content": [c for p in parts for c in p["content"]], "refusal": None}
    return {key: [v for p in parts for v in p[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def choice(index: int, text: str, finish_reason: str | None, chat: bool, final: bool,
           logprobs: dict | None = None, first: bool = False) -> dict:
    """One choice of a response (``final``) or of a streamed chunk (``first``: the role chunk)."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if final:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}
    delta = {"role": "assistant", "content": ""} if first else {"content": text}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def tool_choice(index: int, calls: list[dict], finish_reason: str, logprobs: dict | None = None,
                content: str | None = None) -> dict:
    """A response's chat choice whose answer is ``calls`` (``message.tool_calls``), with the
    ``content`` the model wrote before them (null: none)."""
    return {"index": index, "message": {"role": "assistant", "content": content, "tool_calls": calls},
            "logprobs": logprobs, "finish_reason": finish_reason}


def tool_delta(index: int, calls: list[dict], finish_reason: str | None, logprobs: dict | None = None,
               content: str | None = None) -> dict:
    """A streamed chat choice carrying ``delta.tool_calls`` (each numbered by its ``index``;
    none: left out) and ``delta.content`` when there is some."""
    delta = {"content": content} if content or not calls else {}
    return {"index": index, "delta": {**delta, **({"tool_calls": calls} if calls else {})},
            "logprobs": logprobs, "finish_reason": finish_reason}
