"""What the simulated tenants send: system prompts, documents, questions, chat histories.

Pure functions of a ``random.Random`` and the tenants file, no network and no Locust, so the
same workload is used by the locustfile, the canaries and the tests.

Prefix structure (what the KV cache can reuse), per tenant::

    acme     [pinned system prompt from tenants.yaml][question]          short + multi-turn chat
    globex   [globex system prompt][document k of 4][question]           long-document Q&A
    initech  [document k of 4][summarise instruction]                    batch completions

Each tenant reuses its own prefixes (acme's pinned prompt, globex's prompt + document,
initech's document). globex and initech share the cache scope ``shared:partners``, but their
prompts start differently, so they do not share blocks: only identical leading tokens can be.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DEFAULT_KEYS = {"premium": "kvh-demo-premium", "standard": "kvh-demo-standard", "batch": "kvh-demo-batch"}
KEY_ENV = {"premium": "KVH_KEY_PREMIUM", "standard": "KVH_KEY_STANDARD", "batch": "KVH_KEY_BATCH"}
TENANT_OF = {"premium": "acme", "standard": "globex", "batch": "initech"}

FALLBACK_PREMIUM_PROMPT = (
    "You are Acme's support assistant. Answer briefly and politely, cite the relevant\n"
    "help-center article when there is one, and never reveal internal ticket notes.")
GLOBEX_PROMPT = ("You are Globex's research assistant. Read the document below and answer the "
                 "question using only facts stated in it; say so when the document is silent.")
QUESTIONS = ("How do I reset my password?", "Where is my order?", "Can I change the shipping address?",
             "Why was I charged twice?", "How do I cancel my plan?", "Is there a student discount?",
             "What does error E42 mean?", "How long does a refund take?")
FOLLOW_UPS = ("Thanks. And after that?", "That did not work.", "Can you say it more simply?",
              "What if I am abroad?")
TOPICS = ("harbor logistics", "tidal energy", "container cranes", "port security", "ship fuel",
          "customs rules", "dock labour", "weather routing")


def api_key(qos: str) -> str:
    """API key for a QoS profile: ``$KVH_KEY_<QOS>`` or the public demo key."""
    return os.environ.get(KEY_ENV[qos], DEFAULT_KEYS[qos])


@dataclass(slots=True)
class TenantsInfo:
    """What the load test reads from tenants.yaml: SLOs per class and acme's pinned prompt."""

    ttft_slo_ms: dict[str, float] = field(default_factory=dict)
    premium_prompt: str = FALLBACK_PREMIUM_PROMPT


def read_tenants(path: str | os.PathLike | None) -> TenantsInfo:
    """Parse the parts of a tenants.yaml the load test needs (a missing file gives defaults)."""
    info = TenantsInfo(ttft_slo_ms={"premium": 250.0, "standard": 1000.0, "batch": 30000.0})
    if path is None or not Path(path).is_file():
        return info
    data = yaml.safe_load(Path(path).read_text()) or {}
    for name, spec in (data.get("qos_classes") or {}).items():
        if (spec or {}).get("ttft_slo_ms") is not None:
            info.ttft_slo_ms[name] = float(spec["ttft_slo_ms"])
    for tenant in (data.get("tenants") or {}).values():
        prefixes = (tenant or {}).get("pinned_prefixes") or []
        if (tenant or {}).get("qos") == "premium" and prefixes:
            info.premium_prompt = prefixes[0]
            break
    return info


def document(k: int, sentences: int = 24) -> str:
    """Document ``k`` (deterministic; about 60 bytes = 60 byte-tokens per sentence)."""
    rng = random.Random(1000 + k)
    topic = TOPICS[k % len(TOPICS)]
    lines = [f"Report {k} on {topic}."]
    for i in range(sentences):
        a, b = rng.randrange(10, 99), rng.randrange(100, 999)
        lines.append(f"Section {i}: the {topic} index moved {a} points to {b} units this quarter.")
    return "\n".join(lines)


def premium_messages(info: TenantsInfo, rng: random.Random) -> list[dict]:
    """A fresh short support chat for acme: pinned system prompt + one question."""
    return [{"role": "system", "content": info.premium_prompt},
            {"role": "user", "content": rng.choice(QUESTIONS)}]


def follow_up(history: list[dict], answer: str, rng: random.Random) -> list[dict]:
    """The next turn of a chat: the whole history, the answer, and a follow-up question."""
    return [*history, {"role": "assistant", "content": answer},
            {"role": "user", "content": rng.choice(FOLLOW_UPS)}]


def document_question(rng: random.Random, num_docs: int = 4, sentences: int = 24,
                      k: int | None = None) -> list[dict]:
    """globex: its system prompt, document ``k`` (else one of ``num_docs``), a question about it."""
    k = rng.randrange(num_docs) if k is None else k
    return [{"role": "system", "content": GLOBEX_PROMPT},
            {"role": "user", "content": f"{document(k, sentences)}\n\nQuestion: what moved most in "
                                        f"section {rng.randrange(sentences)}?"}]


def short_chat(rng: random.Random) -> list[dict]:
    """globex: a short chat with no document."""
    return [{"role": "system", "content": GLOBEX_PROMPT}, {"role": "user", "content": rng.choice(QUESTIONS)}]


def batch_prompt(rng: random.Random, num_docs: int = 4, sentences: int = 24) -> str:
    """initech: a raw completion prompt, document first (shareable with globex's scope)."""
    k = rng.randrange(num_docs)
    return f"{document(k, sentences)}\n\nSummarise the report above in one line, item {rng.randrange(10**6)}:"
