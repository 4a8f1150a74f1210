"""Cache isolation between tenants, including the prefix-cache timing side channel.

Tenants (example tenants.yaml): acme is ``private``; globex and initech share
``shared:partners``. The attacker (acme) sends prompts the victim (globex) sent just
before; if the prefix cache leaked across scopes, those would be served from cache and
come back measurably faster. The positive control is the victim re-sending its own prompt,
which *is* a cache hit.

Statistic: per trial, paired differences of latency (``max_tokens: 1``, so latency is the
time to the first and only token): the attacker's ``fresh - victim's prompt`` and the
victim's ``miss - hit``. Medians over ``TRIALS`` trials, conditions interleaved so drift in
machine load cancels. A leak would make the attacker's median difference about as large
as the control's; we require it to be under a quarter of it (and the control to be large).
"""

from __future__ import annotations

import statistics
import time

import httpx

from tests.conftest import TEST_KEYS
from tests.reliability.helpers import DEMO, rand_text

TRIALS = 32
"""Per-request jitter on a loaded 2-core CI machine reached ~100 ms (a miss took 358 ms
there against 172 ms idle): with 16 trials one CI run's median probe-vs-fresh difference
was -68 ms, over a quarter of the 236 ms control, with no hit (the probe came back slower,
not faster). 32 trials halve the median's variance; a real leak (a difference near the
control) still fails by a factor of four."""
PROMPT_TOKENS = 512
MIN_HIT = PROMPT_TOKENS - 16
ATTACKER, VICTIM = DEMO["premium"], DEMO["standard"]        # acme (private), globex (shared)


def _timed(app, key: str, prompt: str) -> tuple[float, int]:
    """(seconds, cached prompt tokens) of a one-token completion."""
    with httpx.Client(base_url=app.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
        start = time.perf_counter()
        r = c.post("/v1/completions", json={"model": app.model, "prompt": prompt, "max_tokens": 1,
                                            "temperature": 0})
        elapsed = time.perf_counter() - start
    assert r.status_code == 200, r.text
    return elapsed, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _trial(app, i: int) -> dict[str, tuple[float, int]]:
    secret, fresh_a, fresh_v = (rand_text(PROMPT_TOKENS, 7000 + 3 * i + k) for k in range(3))
    _timed(app, VICTIM, secret)                     # victim's request fills its cache
    time.sleep(0.3)                                 # its KV events reach the directory
    out = {}
    probes = [("probe", ATTACKER, secret), ("fresh", ATTACKER, fresh_a)]
    for name, key, prompt in probes if i % 2 else probes[::-1]:
        out[name] = _timed(app, key, prompt)
    controls = [("hit", VICTIM, secret), ("miss", VICTIM, fresh_v)]
    for name, key, prompt in controls if i % 2 else controls[::-1]:
        out[name] = _timed(app, key, prompt)
    return out


def test_private_scope_never_hits_and_leaks_no_timing(kvharbor_app):
    _timed(kvharbor_app, ATTACKER, rand_text(64, 1))          # warm up both paths
    _timed(kvharbor_app, VICTIM, rand_text(64, 2))
    trials = [_trial(kvharbor_app, i) for i in range(TRIALS)]
    assert all(t["probe"][1] == 0 and t["fresh"][1] == 0 for t in trials), \
        [t["probe"][1] for t in trials]
    hits = [t for t in trials if t["hit"][1] >= MIN_HIT]
    assert len(hits) >= TRIALS * 3 // 4, [t["hit"][1] for t in trials]
    leak = statistics.median(t["fresh"][0] - t["probe"][0] for t in trials)
    control = statistics.median(t["miss"][0] - t["hit"][0] for t in hits)
    miss = statistics.median(t["miss"][0] for t in trials)
    print(f"median latency of a miss {miss * 1000:.1f} ms; hit saves {control * 1000:.1f} ms; "
          f"attacker's probe-vs-fresh difference {leak * 1000:.1f} ms")
    assert control > 0.3 * miss, "positive control failed: a same-tenant cache hit is not faster"
    assert abs(leak) < 0.25 * control, (leak, control)


def _hits_cache(app, key: str, prompt: str, tries: int = 10) -> None:
    """Send ``prompt`` as ``key`` until it is served from the cache (at least ``MIN_HIT``
    tokens). A positive control: the prompt is cached where ``key`` may use it
    and the routers know where. One send 0.3 s after the first request came back with 0 cached
    tokens in one CI run (and hit in the next; the cause was not established: a gateway whose
    index had not replayed the prompt's KV events yet, its follower polling every 0.2 s when
    idle, would route by load alone)."""
    for _ in range(tries):
        time.sleep(0.3)
        if _timed(app, key, prompt)[1] >= MIN_HIT:
            return
    raise AssertionError(f"{tries} resends of a cached prompt never hit the cache")


def test_the_reverse_direction_never_hits(kvharbor_app):
    """Neither partner tenant (globex, initech) hits a prompt that a private tenant cached.

    The private tenant is of the standard class (private2), not acme: acme's blocks sit in
    the premium classes' pinned region, which standard and batch requests never use, so with
    acme this test passed even with every tenant's scope made public."""
    owner = TEST_KEYS["private2"]
    for i, partner in enumerate((DEMO["standard"], DEMO["batch"])):
        secret = rand_text(PROMPT_TOKENS, 31 + i)
        _timed(kvharbor_app, owner, secret)
        _hits_cache(kvharbor_app, owner, secret)                    # private2 hits its own
        assert _timed(kvharbor_app, partner, secret)[1] == 0


def test_tenants_that_share_a_scope_share_the_cache(kvharbor_app):
    """initech's first send of a prompt that globex cached hits it (one scope); acme's never.
    A new prompt per attempt: initech's own resend would hit what its first send cached."""
    first_sends = []
    for attempt in range(3):
        prompt = rand_text(PROMPT_TOKENS, 40 + attempt)
        assert _timed(kvharbor_app, DEMO["standard"], prompt)[1] == 0       # globex
        _hits_cache(kvharbor_app, DEMO["standard"], prompt)
        first_sends.append(_timed(kvharbor_app, DEMO["batch"], prompt)[1])  # initech, same group
        assert _timed(kvharbor_app, ATTACKER, prompt)[1] == 0               # acme is private
        if first_sends[-1] >= MIN_HIT:
            break
    assert first_sends[-1] >= MIN_HIT, first_sends
