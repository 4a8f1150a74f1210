"""Embeddings (``LLM.embed``, ``Engine.add_request(pooling=...)``): a prompt's embedding is the
final hidden state of its last token, unit length, as transformers computes it, on kvharbor's
forward and on transformers' (a Qwen3 checkpoint: Qwen3-Embedding's architecture); in chunks,
over the prefix cache and batched with generation it does not change, nor does it change the
generation's tokens; its blocks serve later prompts; what it cannot do is refused."""

from __future__ import annotations

import pytest
import torch

from kvharbor import LLM, PoolingParams, SamplingParams
from kvharbor.engine.pooling import PooledOutput

from .conftest import greedy, random_prompt
from .test_other_architectures import ARCHITECTURES, save_checkpoint

ATOL = 1e-4


def hidden_state(llm, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden state (after the last norm) of ``ids``' last token."""
    with torch.no_grad():
        return llm.hf_model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].float()


def unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def vector(out) -> torch.Tensor:
    return torch.tensor(out.outputs.embedding)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="kvharbor/tiny-llama", device="cpu", num_kv_blocks=256, max_num_batched_tokens=64)


@pytest.mark.parametrize("model", ["kvharbor/tiny-llama", "kvharbor/tiny-qwen2"])
def test_an_embedding_is_the_unit_final_hidden_state_of_the_last_token(model):
    llm = LLM(model=model, device="cpu", num_kv_blocks=128, max_num_batched_tokens=64)
    prompts = ["The Thames flows through London.", random_prompt(150, 1), random_prompt(3, 2)]
    outs = llm.embed(prompts)            # 150 tokens: three chunks of <= 64
    assert [o.prompt_token_ids for o in outs] == [llm.encode(p) for p in prompts]
    for o in outs:
        assert o.finished and o.outputs.hidden_size == llm.hf_model.config.hidden_size
        assert abs(vector(o).norm().item() - 1.0) < 1e-5
        torch.testing.assert_close(vector(o), unit(hidden_state(llm, o.prompt_token_ids)), atol=ATOL, rtol=0)
    assert len({tuple(o.outputs.embedding) for o in outs}) == 3
    llm.check_integrity()


def test_a_qwen3_checkpoint_embeds_on_transformers_forward(tmp_path):
    llm = LLM(model=save_checkpoint(ARCHITECTURES["qwen3"], tmp_path), device="cpu", num_kv_blocks=64,
              max_num_batched_tokens=32)
    assert llm.engine.runner.fast is None
    prompts = [random_prompt(70, 3), random_prompt(9, 4)]
    for o, ids in zip(llm.embed(prompts), prompts):
        torch.testing.assert_close(vector(o), unit(hidden_state(llm, ids)), atol=ATOL, rtol=0)
    again = llm.embed([prompts[0]])[0]
    assert again.num_cached_tokens == 64
    torch.testing.assert_close(vector(again), unit(hidden_state(llm, prompts[0])), atol=ATOL, rtol=0)


def test_a_cached_prefix_gives_the_same_vector_and_serves_later_prompts(llm):
    doc = random_prompt(100, 5)
    first = llm.embed(doc)[0]
    again = llm.embed(doc)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 96   # six whole 16-token blocks
    torch.testing.assert_close(vector(again), vector(first), atol=1e-5, rtol=0)
    asked = llm.generate([doc + random_prompt(10, 6)], greedy(4))[0]
    assert asked.num_cached_tokens == 96          # a question about the document reads its blocks
    longer = llm.embed(doc + [7, 8])[0]
    assert longer.num_cached_tokens == 96
    torch.testing.assert_close(vector(longer), unit(hidden_state(llm, doc + [7, 8])), atol=ATOL, rtol=0)
    llm.check_integrity()


def test_embeddings_batched_with_generation_change_neither(llm):
    prompts = [random_prompt(40, 7), random_prompt(90, 8)]
    alone = llm.generate(prompts, greedy(12))
    docs = [random_prompt(70, 9), random_prompt(20, 10)]
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"gen-{i}", ids, greedy(12))
    while not any(r.request_id.startswith("gen") and r.num_output_tokens for r in engine.requests.values()):
        engine.step()                 # the generations are decoding when the embeddings arrive
    for i, ids in enumerate(docs):
        engine.add_request(f"emb-{i}", ids, SamplingParams(max_tokens=1), pooling=PoolingParams())
    outs, mixed = {}, 0
    while engine.has_unfinished():
        step = engine.step()
        kinds = {out.request_id[:3] for out in step}
        mixed += kinds == {"gen", "emb"}          # one step decoded and embedded
        outs.update((out.request_id, out) for out in step if out.finished)
    assert mixed
    assert [outs[f"gen-{i}"].token_ids for i in range(2)] == [o.token_ids for o in alone]
    for i, ids in enumerate(docs):
        out = outs[f"emb-{i}"]
        assert type(out) is PooledOutput and out.token_ids == [] and out.text == ""
        assert out.finish_reason == "stop"
        torch.testing.assert_close(out.embedding, unit(hidden_state(llm, ids)), atol=ATOL, rtol=0)
    llm.check_integrity()


def test_an_embedding_beside_a_prompt_scored_in_the_same_step(llm):
    """A step with prompt-logprob rows selects the sampling rows of the logits and of the
    hidden states alike."""
    scored, doc = random_prompt(30, 13), random_prompt(25, 14)
    want = llm.generate([scored], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
    engine = llm.engine
    engine.add_request("gen", scored, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    engine.add_request("emb", doc, SamplingParams(max_tokens=1), pooling=PoolingParams())
    first = {out.request_id: out for out in engine.step()}      # both prompts in one step
    assert set(first) == {"gen", "emb"}
    torch.testing.assert_close(first["emb"].embedding, unit(hidden_state(llm, doc)),
                               atol=ATOL, rtol=0)
    while engine.has_unfinished():
        engine.step()
    assert [lp and lp.logprob for lp in first["gen"].prompt_logprobs] == \
        pytest.approx([lp and lp.logprob for lp in want.prompt_logprobs], abs=1e-4)


def test_normalize_false_is_the_raw_hidden_state_and_truncation_keeps_the_last_tokens(llm):
    ids = random_prompt(30, 11)
    raw = llm.embed(ids, PoolingParams(normalize=False))[0]
    torch.testing.assert_close(vector(raw), hidden_state(llm, ids), atol=ATOL, rtol=1e-4)
    cut = llm.embed(ids, truncate_prompt_tokens=10)[0]
    assert cut.prompt_token_ids == ids[-10:]
    torch.testing.assert_close(vector(cut), unit(hidden_state(llm, ids[-10:])), atol=ATOL, rtol=0)


def test_dimensions_need_a_matryoshka_model(llm, tmp_path):
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed("hi", PoolingParams(dimensions=8))
    kind, fields = ARCHITECTURES["qwen3"]
    m = LLM(model=save_checkpoint((kind, dict(fields, matryoshka_dimensions=[16, 32])), tmp_path),
            device="cpu", num_kv_blocks=32)
    ids = random_prompt(12, 12)
    small = m.embed(ids, PoolingParams(dimensions=16))[0]
    assert small.outputs.hidden_size == 16
    torch.testing.assert_close(vector(small), unit(hidden_state(m, ids)[:16]), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match=r"supports dimensions \[16, 32\], got 8"):
        m.embed(ids, PoolingParams(dimensions=8))


def test_what_an_embedding_request_cannot_do_is_refused(llm):
    engine, pool = llm.engine, PoolingParams()
    with pytest.raises(ValueError, match="not a turn of a session"):
        engine.add_request("s", [1, 2, 3], SamplingParams(max_tokens=1), session_id="chat", pooling=pool)
    with pytest.raises(ValueError, match="computes its prompt only"):
        engine.add_request("m", [1, 2, 3], SamplingParams(max_tokens=4), pooling=pool)
    with pytest.raises(ValueError, match="computes its prompt only"):
        engine.add_request("p", [1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=1), pooling=pool)
    with pytest.raises(ValueError, match="pooling must be a PoolingParams"):
        engine.add_request("d", [1, 2, 3], SamplingParams(max_tokens=1), pooling={"normalize": True})
    assert not engine.requests
    llm.check_integrity()
