"""Beam search through HTTP (vLLM's ``use_beam_search`` and ``length_penalty``, through the
official openai client) and on the replica that runs it: the choices are the offline engine's
beams, best first, with their logprobs and usage, for a batch of prompts too; a stream carries
the same; a client that goes away stops the search and frees its blocks; what a beam search
cannot honour is a 400 naming the field."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import httpx
import openai
import pytest

from kvharbor.actors.replica import LLMReplica
from kvharbor.platform.protocol import GenerateRequest
from tests.conftest import DEMO, until

PROMPTS = ["The tide comes in and", "Rivers run to the sea,"]


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


@pytest.fixture(scope="module")
def offline():
    from kvharbor import LLM

    return LLM(device="cpu", num_kv_blocks=64)


def test_completions_choices_are_the_offline_engines_beams(client, kvharbor_app, offline):
    from kvharbor.engine.beam_search import BeamSearchParams

    want = offline.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True,
                                                         length_penalty=0.5))
    out = client.completions.create(model=kvharbor_app.model, prompt=PROMPTS, n=3, max_tokens=8, logprobs=2,
                                    extra_body={"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5,
                                                "return_token_ids": True})
    assert [c.index for c in out.choices] == list(range(6))
    for choice in out.choices:                  # choice p * n + j: prompt p's j-th best beam
        p, j = divmod(choice.index, 3)
        ids = offline.encode(PROMPTS[p])
        seq = want[p].sequences[j]
        assert choice.token_ids == seq.tokens[len(ids):]
        assert choice.text == offline.tokenizer.decode(seq.tokens[len(ids):], skip_special_tokens=True)
        assert choice.finish_reason == "length"
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(seq.cum_logprob, abs=1e-3)
        # the 2 most likely, and the beam's own token when it is not one of them
        assert all(len(top) in (2, 3) and choice.logprobs.tokens[i] in top
                   for i, top in enumerate(choice.logprobs.top_logprobs))
    assert all(len({tuple(c.token_ids) for c in out.choices[p * 3:p * 3 + 3]}) == 3 for p in range(2))
    assert out.usage.prompt_tokens == sum(len(offline.encode(p)) for p in PROMPTS)     # each prompt once
    assert out.usage.completion_tokens == 6 * 8
    # width 1 is greedy
    greedy = client.completions.create(model=kvharbor_app.model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    beam = client.completions.create(model=kvharbor_app.model, prompt=PROMPTS[0], max_tokens=8, temperature=0.9,
                                     top_p=0.5, seed=3,    # they change nothing in a beam search
                                     extra_body={"use_beam_search": True, "ignore_eos": True})
    assert beam.choices[0].text == greedy.choices[0].text


def test_stop_token_ids_min_tokens_and_the_length_penalty_reach_the_search(client, kvharbor_app, offline):
    from kvharbor.engine.beam_search import BeamSearchParams

    ids = offline.encode(PROMPTS[1])
    first = offline.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=1, max_tokens=1))[0].sequences[0].tokens[-1]
    # the most likely first token ends a beam; without min_tokens it would end the best beam at once
    params = BeamSearchParams(beam_width=2, max_tokens=6, stop_token_ids=[first], min_tokens=1, length_penalty=3.0)
    want = offline.beam_search([PROMPTS[1]], params)[0].sequences
    assert all(len(s.tokens) - len(ids) >= 2 for s in want) and want[0].finish_reason == "stop"
    unpenalized = offline.beam_search([PROMPTS[1]], dataclasses.replace(params, length_penalty=1.0))[0].sequences
    assert [s.tokens for s in unpenalized] != [s.tokens for s in want]     # the penalty changes the order
    out = client.completions.create(model=kvharbor_app.model, prompt=PROMPTS[1], n=2, max_tokens=6,
                                    extra_body={"use_beam_search": True, "stop_token_ids": [first], "min_tokens": 1,
                                                "length_penalty": 3, "return_token_ids": True})
    assert [(c.token_ids, c.finish_reason, c.stop_reason) for c in out.choices] == \
        [(s.tokens[len(ids):], s.finish_reason, s.stop_reason) for s in want]
    assert out.choices[0].stop_reason == first
    assert out.choices[0].text == offline.tokenizer.decode(want[0].tokens[len(ids):-1])   # the stop token is not text


def test_a_chat_stream_sends_the_beams_the_answer_has(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, messages=[{"role": "user", "content": "Name a colour"}], n=2, max_tokens=6,
              extra_body={"use_beam_search": True, "return_token_ids": True, "ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert len(whole.choices) == 2 and whole.choices[0].token_ids != whole.choices[1].token_ids
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == len(whole.prompt_token_ids)
    text, reasons = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 12
    assert [text[0], text[1]] == [c.message.content for c in whole.choices]
    assert reasons == {0: "length", 1: "length"}


@pytest.mark.parametrize("extra,param", [
    ({"stop": ["x"]}, "stop"), ({"logit_bias": {"65": 5}}, "logit_bias"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"bad_words": ["sea"]}, "bad_words"),
    ({"allowed_token_ids": [65, 66]}, "allowed_token_ids"),
    ({"response_format": {"type": "json_object"}}, "use_beam_search"),
    ({"structured_outputs": {"regex": "[ab]+"}}, "use_beam_search")])
def test_what_a_beam_search_cannot_honour_is_refused(kvharbor_app, extra, param):
    with httpx.Client(base_url=kvharbor_app.base_url, headers={"Authorization": f"Bearer {DEMO['standard']}"},
                      timeout=30) as c:          # the first structured request imports xgrammar
        r = c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": "hi", "max_tokens": 2,
                                            "use_beam_search": True, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        ok = c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": "hi", "max_tokens": 2, **extra})
        assert ok.status_code == 200, ok.text               # the same field without beam search is fine


def test_beam_search_fields_out_of_place_are_refused(kvharbor_app):
    body = {"model": kvharbor_app.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=kvharbor_app.base_url, headers={"Authorization": f"Bearer {DEMO['standard']}"}) as c:
        turn = c.post("/v1/chat/completions", json={**body, "use_beam_search": True}, headers={"X-Session-ID": "beams"})
        assert turn.status_code == 400 and turn.json()["error"]["param"] == "use_beam_search"
        wide = c.post("/v1/chat/completions", json={**body, "use_beam_search": True, "n": 9})
        assert wide.status_code == 400 and wide.json()["error"]["param"] == "n"
        neutral = c.post("/v1/chat/completions", json={**body, "use_beam_search": True, "stop": [], "logit_bias": {},
                                                       "length_penalty": 1.0, "tool_choice": "none"})
        assert neutral.status_code == 200 and neutral.json()["usage"]["completion_tokens"] >= 1


def _beam_request(rid: str, width: int, max_tokens: int, prompt_len: int = 20) -> GenerateRequest:
    return GenerateRequest(request_id=rid, tenant="t", qos="standard", prompt_token_ids=[1 + i % 250 for i in range(prompt_len)],
                           block_hashes=[], sampling={"max_tokens": max_tokens}, beam={
                               "beam_width": width, "max_tokens": max_tokens, "ignore_eos": True})


def test_a_search_whose_client_goes_away_stops_and_frees_its_blocks():
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 128})
    engine = replica.engine

    async def scenario():
        done = [e async for e in replica.generate(_beam_request("short", 2, 3))]
        search = asyncio.create_task(anext(replica.generate(_beam_request("long", 8, 400))))
        await until(lambda: engine.stats()["requests_finished"] >= 2 * 3 + 8 * 3, 60, poll_s=0.01)
        search.cancel()
        await asyncio.gather(search, return_exceptions=True)
        await until(lambda: not engine.has_unfinished() and not replica._streams, 30, poll_s=0.01)
        return done

    done = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert [e["beam"] for e in done] == [0, 1] and all(len(e["token_ids"]) == 3 for e in done)
    assert done[0]["replica_ms"] > 0 and "replica_ms" not in done[1]
    finished = engine.stats()["requests_finished"]
    assert finished < 2 * 3 + 8 * 400, "the search ran on after its client went away"
    assert engine.stats()["blocks_used"] == 0
    engine.check_integrity()


def test_a_round_aborted_on_the_replica_ends_the_search_as_aborted():
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 128})
    engine, gate = replica.engine, threading.Event()
    step = engine.step

    def held_at_round_two():        # the step thread waits while round 2's requests are queued
        if any(rid.startswith("cut/b2.") for rid in engine.requests):
            gate.wait(30)
        return step()

    engine.step = held_at_round_two

    async def scenario():
        events = asyncio.create_task(_collect(replica, _beam_request("cut", 4, 400)))
        await until(lambda: gate.is_set() or sum(r.startswith("cut/b2.") for r in replica._streams) == 4, 60)
        assert await replica.abort("cut/b2.1")
        gate.set()
        return await events

    events = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert len(events) == 1 and events[0]["finish_reason"] == "abort" and events[0]["token_ids"] == []
    asyncio.run(until(lambda: not engine.has_unfinished(), 30))
    assert engine.stats()["blocks_used"] == 0 and engine.stats()["requests_finished"] < 4 * 4


def test_a_round_the_engine_refuses_ends_the_search_with_its_error():
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 8})
    too_big = asyncio.run(asyncio.wait_for(_collect(replica, _beam_request("big", 2, 4, prompt_len=400)), 30))
    assert len(too_big) == 1 and too_big[0]["status"] == 400 and "KV blocks" in too_big[0]["error"]
    bad = _beam_request("bad", 2, 4)
    bad.beam["beam_width"] = 0
    refused = asyncio.run(asyncio.wait_for(_collect(replica, bad), 30))
    assert len(refused) == 1 and refused[0]["status"] == 400 and "beam_width" in refused[0]["error"]
    assert not replica.engine.has_unfinished()


async def _collect(replica: LLMReplica, request: GenerateRequest) -> list[dict]:
    return [event async for event in replica.generate(request)]
