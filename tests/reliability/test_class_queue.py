"""ClassQueue (no Ray): a class waits behind itself and every higher class; leave frees room."""

from __future__ import annotations

from kvharbor.platform.class_queue import ClassQueue

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
    q = ClassQueue({"gold": 5})
    assert q.enter("batch", PRIORITIES, 1) is None


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
