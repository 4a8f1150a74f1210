"""ClassQueue (no Ray): a class waits behind itself and every higher class; leave frees room."""

from __future__ import annotations

from kvharbor.platform.class_queue import ClassQueue
from kvharbor.tenants.leases import LeaseTable

PRIORITIES = {"premium": 100, "standard": 50, "batch": 10}


def test_lower_classes_are_refused_first_and_premium_only_counts_itself():
    q = ClassQueue()
    assert [q.enter("batch", PRIORITIES, 4) for _ in range(3)] == [None] * 3
    assert [q.enter("standard", PRIORITIES, 4) for _ in range(3)] == [None] * 3
    assert q.enter("batch", PRIORITIES, 4) == 6            # all six are ahead of batch
    assert q.enter("standard", PRIORITIES, 4) is None      # only 3 standard ahead
    assert q.enter("standard", PRIORITIES, 4) == 4
    assert [q.enter("premium", PRIORITIES, 4) for _ in range(5)] == [None] * 4 + [4]
    assert q.snapshot() == {"batch": 3, "standard": 4, "premium": 4}


def test_leave_frees_room_and_never_goes_negative():
    q = ClassQueue()
    assert q.enter("batch", PRIORITIES, 1) is None
    assert q.enter("batch", PRIORITIES, 1) == 1
    q.leave("batch")
    q.leave("batch")
    assert q.snapshot() == {"batch": 0}
    assert q.enter("batch", PRIORITIES, 1) is None


def test_classes_removed_from_the_config_are_not_counted():
    """Requests of a class tenants.yaml no longer lists shed no class, even one of priority 0."""
    q = ClassQueue({"gold": 5})
    assert q.enter("batch", PRIORITIES, 1) is None
    assert q.enter("free", {"free": 0}, 1) is None


def test_status_counts_requests_not_the_places_a_gateway_holds_idle():
    """A gateway's grant of premium places counts as taken (max_queue holds across gateways)
    but the operator's view of requests in flight leaves its idle places out."""
    q = ClassQueue()
    assert q.enter("standard", PRIORITIES, 10) is None
    # (qos, max_queue, back, want, held, free): ask for 4 places, none held yet
    assert q.sync_places("gw-a", PRIORITIES, [("premium", 10, 0, 4, False, 0)], seq=1) == \
        [("premium", 4, True, False)]
    assert q.snapshot() == {"standard": 1, "premium": 4}
    assert q.status() == {"in_flight": {"standard": 1, "premium": 0}, "granted_idle": {"premium": 4}}
    # one premium request admitted from the grant, reported at the next sync: 3 idle
    q.sync_places("gw-a", PRIORITIES, [("premium", 10, 0, 1, True, 3)], seq=2)
    assert q.status()["in_flight"]["premium"] == 1


def test_a_refusal_recalls_idle_places_only_when_they_would_have_admitted_it():
    """Gateway A holds 4 idle premium places. A premium refusal calls them back when, without
    them, the request fits; when the class is over the limit even without them (max_queue was
    lowered) nothing is recalled: A keeps its fast lane."""
    q = ClassQueue()
    assert q.sync_places("gw-a", PRIORITIES, [("premium", 10, 0, 4, False, 0)], seq=1) == \
        [("premium", 4, True, False)]
    assert [q.enter("premium", PRIORITIES, 10) for _ in range(7)] == [None] * 6 + [10]
    assert q.enter_or_recall("premium", PRIORITIES, 5) == (10, False)      # 6 in flight > 5
    assert q.enter_or_recall("premium", PRIORITIES, 6) == (10, False)      # 6 in flight: full
    assert not q.recall
    assert q.enter_or_recall("premium", PRIORITIES, 10) == (10, True)      # 6 < 10 without them
    assert q.recall == {("gw-a", "premium")}


def test_a_recalled_grant_is_not_topped_up_in_the_sync_that_gives_it_back():
    """The places a recall brings back are for the refused request's retry: the sync that
    gives them back gets none (recall True, added 0), and the retry is admitted."""
    q = ClassQueue()
    q.sync_places("gw-a", PRIORITIES, [("premium", 6, 0, 3, False, 0)], seq=1)      # 3 idle
    assert [q.enter("premium", PRIORITIES, 6) for _ in range(4)] == [None] * 3 + [6]
    assert q.enter_or_recall("premium", PRIORITIES, 6) == (6, True)
    # (qos, max_queue, back, want, held, free): A gives its 3 back and asks for 3 again
    assert q.sync_places("gw-a", PRIORITIES, [("premium", 6, 3, 3, True, 0)], seq=2) == \
        [("premium", 0, True, True)]
    assert q.enter_or_recall("premium", PRIORITIES, 6, "retry") == (None, False)
    # The recall is answered once: A's next sync is topped up again (4 in flight, 2 places
    # left, half of them granted).
    assert q.sync_places("gw-a", PRIORITIES, [("premium", 6, 0, 3, False, 0)], seq=3) == \
        [("premium", 1, True, False)]


def test_a_standard_refusal_leaves_premiums_idle_places_alone():
    q = ClassQueue()
    q.sync_places("gw-a", PRIORITIES, [("premium", 10, 0, 4, False, 0)], seq=1)
    assert [q.enter("standard", PRIORITIES, 3) for _ in range(4)] == [None] * 3 + [3]
    assert q.enter_or_recall("standard", PRIORITIES, 3) == (3, False)
    assert not q.recall


def test_a_place_renewed_after_its_lease_ran_out_is_gone():
    """A gateway that could not renew for a whole lease gets its place back as unknown (it was
    given back), not revived on top of the places others have taken since."""
    q = ClassQueue(leases=LeaseTable(10))
    assert q.enter("standard", PRIORITIES, 5, "p", now=0.0) is None
    assert q.renew(["p"], now=11.0) == ["p"]
    assert q.snapshot() == {"standard": 0}


def test_a_dead_gateways_idle_places_stop_counting_as_idle():
    """Gateway A holds 4 idle premium places and dies (its holder lease runs out): the places
    come back, and neither the operator's status nor standard's shedding still counts them."""
    q = ClassQueue(leases=LeaseTable(10), holders=LeaseTable(10))
    q.sync_places("gw-a", PRIORITIES, [("premium", 10, 0, 4, False, 0)], seq=1, now=0.0)
    assert q.expire(now=11.0) == 1
    assert q.snapshot() == {"premium": 0}
    assert q.status() == {"in_flight": {"premium": 0}, "granted_idle": {}}
    assert [q.enter("standard", PRIORITIES, 2, now=11.0) for _ in range(3)] == [None, None, 2]


def test_a_gateway_gives_back_no_more_places_than_it_was_granted():
    """A sync reporting more places given back than the gateway was granted frees only its own
    places, never those of requests in flight elsewhere."""
    q = ClassQueue()
    assert [q.enter("premium", PRIORITIES, 10) for _ in range(4)] == [None] * 4
    # (qos, max_queue, back, want, held, free): room 6, a grant takes at most half: 3
    assert q.sync_places("gw-a", PRIORITIES, [("premium", 10, 0, 4, False, 0)], seq=1) == \
        [("premium", 3, True, False)]
    q.sync_places("gw-a", PRIORITIES, [("premium", 10, 5, 0, True, 0)], seq=2)
    assert q.snapshot() == {"premium": 4}


def test_a_grant_of_places_leaves_room_for_the_classes_above():
    """The room a grant is cut from is max_queue less the places of its class and of every
    class above it: 8 critical requests in flight leave premium 2, of which a grant takes 1."""
    priorities = {"critical": 200, **PRIORITIES}
    q = ClassQueue()
    assert [q.enter("critical", priorities, 10) for _ in range(8)] == [None] * 8
    assert q.sync_places("gw-a", priorities, [("premium", 10, 0, 4, False, 0)], seq=1) == \
        [("premium", 1, True, False)]


def test_a_sync_sent_again_after_the_gateways_lease_ran_out_is_answered_afresh():
    """Gateway A's answer was lost and it could not reach the queue for longer than its lease:
    its grant was given back meanwhile. Its resend (same seq) is settled again, so the places
    the answer tells it it holds are counted, not a stored answer's places that nobody counts."""
    q = ClassQueue(leases=LeaseTable(10), holders=LeaseTable(10))
    report = [("premium", 10, 0, 4, False, 0)]
    assert q.sync_places("gw-a", PRIORITIES, report, seq=1, now=0.0) == [("premium", 4, True, False)]
    assert q.expire(now=11.0) == 1 and q.snapshot() == {"premium": 0}
    again = q.sync_places("gw-a", PRIORITIES, report, seq=1, now=11.0)
    assert again == [("premium", 4, True, False)] and q.snapshot() == {"premium": 4}
