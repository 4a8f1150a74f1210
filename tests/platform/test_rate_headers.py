"""OpenAI's ``x-ratelimit-*`` headers: their duration format, which limits they name, and
the admission service's count behind ``remaining`` and ``reset`` (through HTTP:
``test_tenant_enforcement``)."""

from __future__ import annotations

import pytest

from kvharbor.platform import rate_headers
from kvharbor.tenants.limits import AdmissionController
from kvharbor.tenants.schema import TenantLimits


@pytest.mark.parametrize("seconds, text", [(0.0, "0ms"), (0.0204, "20ms"), (1.0, "1s"), (1.25, "1.25s"),
                                           (12.4, "12s"), (60.0, "1m0s"), (360.0, "6m0s"),
                                           (3725.0, "1h2m5s"),
                                           # a value that rounds up reads in the next range
                                           (0.9996, "1s"), (9.996, "10s"), (59.6, "1m0s"),
                                           (3599.6, "1h0m0s")])
def test_durations_read_as_openais(seconds, text):
    assert rate_headers.duration(seconds) == text


def test_only_the_limits_a_tenant_has_are_named_and_remaining_only_when_counted():
    limits = TenantLimits(requests_per_minute=60, tokens_per_minute=None)
    assert rate_headers.headers_for(limits, {}) == [(b"x-ratelimit-limit-requests", b"60")]
    assert rate_headers.headers_for(limits, {"requests": (41, 19.0), "tokens": (5, 1.0)}) == [
        (b"x-ratelimit-limit-requests", b"60"), (b"x-ratelimit-remaining-requests", b"41"),
        (b"x-ratelimit-reset-requests", b"19s")]


def test_a_note_outside_a_request_is_dropped_and_inside_one_is_kept():
    rate_headers.note({"requests": (1, 1.0)})            # no request: nothing to fill, no error
    with rate_headers.opened() as record:
        rate_headers.note({"requests": (3, 2.0)})
    rate_headers.note({"requests": (2, 1.0)})            # after the request: not its answer
    assert record == {"requests": (3, 2.0)}
    with rate_headers.opened() as fresh:
        pass
    assert fresh == {}


def test_the_service_says_what_is_left_after_each_admission_and_refusal():
    now = [1000.0]
    controller = AdmissionController(clock=lambda: now[0])
    limits = TenantLimits(requests_per_minute=2, tokens_per_minute=600)
    first = controller.try_admit("t", limits, prompt_tokens=90, max_tokens=10)
    assert first.ok and first.rates == {"requests": (1, 30.0), "tokens": (500, 10.0)}, first.rates
    now[0] += 3.0                                     # 0.1 request and 30 tokens come back
    second = controller.try_admit("t", limits, prompt_tokens=20, max_tokens=10)
    assert second.ok and second.rates["requests"][0] == 0 and second.rates["tokens"][0] == 500, second.rates
    assert second.rates["requests"][1] == pytest.approx(57.0), second.rates
    now[0] += 15.0                                    # 0.6 of a request: none whole yet
    refused = controller.try_admit("t", limits, prompt_tokens=20, max_tokens=10)
    assert refused.status == 429 and refused.rates["requests"][0] == 0, refused
    too_big = controller.try_admit("t", limits, prompt_tokens=900, max_tokens=10)
    assert too_big.status == 400 and too_big.rates is None
    unlimited = controller.try_admit("u", TenantLimits(), prompt_tokens=1, max_tokens=1)
    assert unlimited.ok and unlimited.rates == {}
