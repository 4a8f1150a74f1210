"""Integrity canaries: greedy prompts whose exact completions are known before the run.

Before a load test, :func:`compute_canaries` runs each canary prompt through the offline
``LLM`` on the served model (same weights: the builtin models are seeded with 0) with greedy
sampling and ``ignore_eos``; the expected text is stored in ``canaries.json``. During the run
the load test sends the same prompts over HTTP now and then (``temperature: 0``,
``ignore_eos: true``, the same ``max_tokens``) and every answer must equal the stored one,
character for character. A mismatch means the serving path changed what the model computes
under load (a wrong KV block reused, a batching or preemption bug) and fails the run.

The canary prompts start with each tenant's real shared prefix (acme's pinned system prompt,
globex's document prefix, initech's document), so they are served from cached / pinned
blocks that other requests of the load test fill and share.

Invariant: expectations are only valid for the model, device and dtype they were computed
with; a server on a GPU in bf16 needs canaries computed on that device and dtype.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtests import workload

CANARY_MAX_TOKENS = 16


@dataclass(slots=True)
class Canary:
    """One canary prompt (sent by the user class of ``qos``) and its expected completion."""

    name: str
    qos: str
    prompt: str
    max_tokens: int
    expected_text: str = ""
    expected_tokens: int = 0


def canary_prompts(info: workload.TenantsInfo, max_tokens: int = CANARY_MAX_TOKENS) -> list[Canary]:
    """The canary prompts, one or two per QoS profile, each on that tenant's shared prefix."""
    doc_q = workload.document_question(random.Random(7))
    return [
        Canary("premium-pinned", "premium", f"{info.premium_prompt}\n\nCustomer: where is my order?",
               max_tokens),
        Canary("premium-plain", "premium", "The harbor at dawn", max_tokens),
        Canary("standard-document", "standard", f"{doc_q[0]['content']}\n\n{doc_q[1]['content']}",
               max_tokens),
        Canary("batch-document", "batch", workload.batch_prompt(random.Random(11)), max_tokens),
    ]


def compute_canaries(model: str, info: workload.TenantsInfo, max_tokens: int = CANARY_MAX_TOKENS,
                     device: str = "cpu", dtype: str = "auto") -> list[Canary]:
    """Expected completions from the offline engine (greedy, ``ignore_eos``), one request each."""
    from kvharbor import LLM, SamplingParams  # noqa: PLC0415 - torch only when computing

    llm = LLM(model=model, device=device, dtype=dtype, num_kv_blocks=512)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for canary in canary_prompts(info, max_tokens):
        result = llm.generate([canary.prompt], params)[0]
        canary.expected_text = result.text
        canary.expected_tokens = len(result.token_ids)
        out.append(canary)
    return out


def save(canaries: list[Canary], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(c) for c in canaries], indent=1, ensure_ascii=False))


def load(path: str | Path | None) -> list[Canary]:
    """Canaries from ``path``; an empty list when there is no file (canaries off)."""
    if not path or not Path(path).is_file():
        return []
    return [Canary(**c) for c in json.loads(Path(path).read_text())]


def body(canary: Canary, model: str, stream: bool) -> dict:
    """The /v1/completions body that must reproduce ``canary.expected_text``."""
    out = {"model": model, "prompt": canary.prompt, "max_tokens": canary.max_tokens,
           "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


def mismatch(canary: Canary, text: str, completion_tokens: int | None) -> str | None:
    """None when the answer equals the expectation, else a one-line description of the difference."""
    if text == canary.expected_text and completion_tokens in (None, canary.expected_tokens):
        return None
    at = next((i for i, (a, b) in enumerate(zip(text, canary.expected_text)) if a != b),
              min(len(text), len(canary.expected_text)))
    return (f"canary {canary.name}: got {text!r} ({completion_tokens} tokens), expected "
            f"{canary.expected_text!r} ({canary.expected_tokens} tokens); first difference at char {at}")
