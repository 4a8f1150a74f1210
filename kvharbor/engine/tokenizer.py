"""A byte-level tokenizer for the builtin models: 256 byte tokens + <pad>, <s>, </s>.

It is a real ``PreTrainedTokenizerFast`` (so chat templates, ``save_pretrained`` and the
whole transformers API work) built offline: ids 0-255 are the bytes, no merges.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<s>", "</s>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer (deterministic, no files needed)."""
    byte_to_char = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps every byte to a printable char; order the vocab by byte value.
    mapping = _bytes_to_unicode()
    vocab = {mapping[b]: b for b in range(256)}
    assert set(vocab) == set(byte_to_char)
    vocab.update({PAD: 256, BOS: 257, EOS: 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


TEMPLATE_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
    "pad_token", "unk_token", "raise_exception", "strftime_now",
    "range", "dict", "lipsum", "cycler", "joiner", "namespace", "loop"})
"""Names ``apply_chat_template``, the template or Jinja already give a meaning."""


def template_kwargs(kwargs: dict | None) -> dict:
    """vLLM's ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``): extra variables
    for the chat template. Raises ValueError for a key that is not a name or that would
    replace one the template is already given."""
    kwargs = kwargs or {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {type(kwargs).__name__}")
    for key in kwargs:
        if not (isinstance(key, str) and key.isidentifier()) or key in TEMPLATE_NAMES:
            raise ValueError(f"chat_template_kwargs may not set {key!r}: use a name the chat "
                             f"template reads, other than {sorted(TEMPLATE_NAMES)}")
    return kwargs


def chat_token_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    """``messages`` through ``tokenizer``'s chat template, as token ids (``kwargs`` are
    ``apply_chat_template``'s; it answers a list or a BatchEncoding, by version and options)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table that ByteLevel uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
