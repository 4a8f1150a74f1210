"""Block hashes: what makes two blocks the same, and what must keep them apart."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.engine.hashing import (adapter_salt, hash_block, hash_prompt_blocks, model_root,
                                     with_request_salt)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 50_000), max_size=70), block_size=st.sampled_from([1, 4, 16]),
       start=st.integers(0, 6))
def test_a_chain_is_its_blocks_hashed_in_turn_and_resumes_from_any_block(tokens, block_size, start):
    """Each full block's hash is ``hash_block(previous hash, its own tokens)``; the engine
    hashes a growing sequence from where it stopped, which must give the gateway's hashes."""
    root = model_root("m")
    whole = hash_prompt_blocks(tokens, block_size, "s", parent=root)
    expected, parent = [], root
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size], "s")
        expected.append(parent)
    assert whole == expected
    start = min(start, len(whole))
    resumed = hash_prompt_blocks(tokens, block_size, "s", start=start,
                                 parent=whole[start - 1] if start else root)
    assert resumed == whole[start:]


def test_one_string_sent_as_cache_salt_by_two_scopes_shares_nothing_between_them():
    """vLLM's ``cache_salt``: reuse needs the same scope (tenant) *and* the same string."""
    tokens = list(range(32))
    a = with_request_salt("tenant-a", "user-1")
    b = with_request_salt("tenant-b", "user-1")
    public = with_request_salt(None, "user-1")
    assert len({a, b, public}) == 3
    assert with_request_salt("tenant-a", "user-1") == a
    assert with_request_salt("tenant-a", None) == "tenant-a"
    chains = [hash_prompt_blocks(tokens, 16, s) for s in (a, b, public, "tenant-a", None)]
    assert len({c[0] for c in chains}) == 5


def test_a_salt_spelled_to_look_like_another_scope_is_not_that_scope():
    """The request's string enters as a digest: it cannot name an adapter's or a scope's salt."""
    forged = with_request_salt(None, "x|lora:a@/w")
    assert forged != adapter_salt("x", "a", "/w") and "lora" not in forged


def test_an_adapter_is_its_own_scope_per_checkpoint_path():
    assert adapter_salt("t", None) == "t"
    one, other = adapter_salt("t", "sql", "/ckpt/v1"), adapter_salt("t", "sql", "/ckpt/v2")
    assert one != other and adapter_salt("t", "sql", "/ckpt/v1/") == one
    assert adapter_salt("u", "sql", "/ckpt/v1") != one


def test_each_model_starts_its_own_chain_and_no_identity_is_the_zero_root():
    tokens = list(range(16))
    assert model_root(None) is None
    assert model_root("m@1") != model_root("m@2") and model_root("m@1") == model_root("m@1")
    zero = hash_prompt_blocks(tokens, 16)
    assert zero == hash_prompt_blocks(tokens, 16, parent=None) == [hash_block(None, tokens)]
    assert len({zero[0], *hash_prompt_blocks(tokens, 16, parent=model_root("m@1")),
                *hash_prompt_blocks(tokens, 16, parent=model_root("m@2"))}) == 3
