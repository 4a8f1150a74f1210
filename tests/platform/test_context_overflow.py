"""context_overflow: truncate_oldest drops the oldest turns and keeps the system prompt."""

from __future__ import annotations

import pytest

from kvharbor.platform.context_overflow import truncate_oldest
from tests.conftest import DEMO, TEST_KEYS


def render(messages: list[dict]) -> list[int]:
    """One token per character plus one per message (a stand-in for a chat template)."""
    return [0] * sum(len(m["content"]) + 1 for m in messages)


def chat(turns: int, size: int = 100) -> list[dict]:
    messages = [{"role": "system", "content": "S" * 20}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"u{i}".ljust(size, ".")},
                     {"role": "assistant", "content": f"a{i}".ljust(size, ".")}]
    return messages + [{"role": "user", "content": "last".ljust(size, ".")}]


def test_fitting_chat_is_untouched():
    fitted = truncate_oldest(chat(2), render, 10_000)
    assert fitted.dropped_tokens == 0 and len(fitted.token_ids) == len(render(chat(2)))
    exact = len(render(chat(2)))                     # exactly the limit fits too
    assert truncate_oldest(chat(2), render, exact).dropped_messages == 0


def test_a_truncated_chat_may_fill_the_limit_exactly():
    messages = chat(5)
    limit = len(render(messages)) - 2 * 101          # room once u0 and a0 are gone
    fitted = truncate_oldest(messages, render, limit)
    assert fitted.dropped_messages == 2 and len(fitted.token_ids) == limit


def test_an_assistant_turn_is_not_left_first():
    """Dropping u0 alone would fit, but the chat would then open with a0: a0 goes too."""
    messages = chat(5)
    kept = []
    fitted = truncate_oldest(messages, lambda m: kept.append(m) or render(m), len(render(messages)) - 101)
    assert fitted.dropped_messages == 2 and [m["content"][:2] for m in kept[-1][:2]] == ["SS", "u1"]


def test_a_tool_result_is_not_left_first_without_its_call():
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}
    messages = [{"role": "user", "content": "u" * 100}, call, {"role": "tool", "content": "t" * 100},
                {"role": "tool", "content": "t" * 10}, {"role": "user", "content": "next"}, {"role": "user", "content": "last"}]
    kept = []
    fitted = truncate_oldest(messages, lambda m: kept.append(m) or render(m), 21)   # [t*10, next, last] would fit
    assert [m["content"] for m in kept[-1]] == ["next", "last"] and fitted.dropped_messages == 4


def test_oldest_turns_go_first_and_system_and_last_stay():
    messages = chat(5)                               # 21 + 11 * 101 = 1132 tokens
    kept = []
    fitted = truncate_oldest(messages, lambda m: kept.append(m) or render(m), 600)
    final = kept[-1]
    assert final[0]["role"] == "system" and final[-1]["content"].startswith("last")
    assert final[1]["role"] == "user"                # restarts with a user turn
    assert [m["content"][:2] for m in final[1:-1]] == ["u3", "a3", "u4", "a4"]
    assert fitted.dropped_tokens == len(render(messages)) - len(render(final)) == 6 * 101
    assert len(fitted.token_ids) <= 600 and fitted.dropped_messages == 6


def test_the_one_turn_before_the_last_may_go_too():
    """A chat of the system prompt, one long question and the last one: the long one goes
    when the system prompt and the last message fit alone."""
    messages = [*chat(0)[:1], {"role": "user", "content": "u" * 500}, *chat(0)[1:]]
    fitted = truncate_oldest(messages, render, len(render(chat(0))))
    assert (fitted.dropped_messages, fitted.dropped_tokens) == (1, 501)


def test_the_last_message_stays_when_it_is_an_assistant_turn():
    """A chat that ends with an assistant turn (an answer to continue): the turns before it
    go, the last one stays even though it is an assistant's."""
    messages = chat(2)[:-1]                          # ... u1, a1
    fitted = truncate_oldest(messages, render, 21 + 101)
    assert (fitted.dropped_messages, len(fitted.token_ids)) == (3, 21 + 101)


def test_nothing_is_dropped_when_even_system_plus_last_do_not_fit():
    fitted = truncate_oldest(chat(3), render, 50)
    assert fitted.dropped_tokens == 0 and len(fitted.token_ids) == len(render(chat(3)))


@pytest.mark.parametrize("key,status", [(TEST_KEYS["truncating"], 200), (DEMO["standard"], 400)])
def test_over_long_chat_is_served_only_for_a_truncating_tenant(kvharbor_app, key, status):
    messages = chat(12, size=400)                    # about 10,000 tokens > 4,096 context
    with kvharbor_app.client(key) as c:
        r = c.post("/v1/chat/completions", json={"model": kvharbor_app.model, "messages": messages,
                                                  "max_tokens": 4, "temperature": 0})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["code"] == "context_length_exceeded"
        return
    body = r.json()
    dropped = int(r.headers["x-truncated-tokens"])
    assert dropped == body["kvharbor"]["truncated_prompt_tokens"] > 5000
    assert body["usage"]["prompt_tokens"] + 4 <= 4096
    assert body["choices"][0]["finish_reason"] == "length"
