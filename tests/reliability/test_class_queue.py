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
