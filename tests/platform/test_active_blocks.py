"""What a router counts before KV events arrive: the blocks it just sent to each replica
(``ActiveBlocks``) and its own routing history (``RoutingHistory``)."""

from __future__ import annotations

from kvharbor.actors.prefix_directory import MatchInfo
from kvharbor.platform.active_blocks import ActiveBlocks, RoutingHistory, with_active


def make(ttl_s: float = 5.0, max_per_replica: int = 65_536):
    now = [0.0]
    return ActiveBlocks(ttl_s, max_per_replica, clock=lambda: now[0]), now


def test_sent_blocks_count_until_their_ttl_runs_out():
    active, now = make(ttl_s=5.0)
    active.add("a", ["h0", "h1", "h2"])
    now[0] = 4.9
    assert active.count("a") == 3 and active.replicas() == ["a"]
    now[0] = 5.0
    assert active.count("a") == 0 and active.replicas() == []


def test_a_block_sent_again_lives_a_full_ttl_from_its_last_send():
    """A re-sent hash moves behind the newer ones: the map stays ordered by expiry, so the
    ones sent only once expire on time, and the re-sent one only a ttl after its last send."""
    active, now = make(ttl_s=5.0)
    active.add("a", ["h0", "h1"])
    now[0] = 3.0
    active.add("a", ["h0"])
    now[0] = 6.0                                    # h1 (sent at 0) expired, h0 (at 3) not
    assert active.count("a") == 1
    assert active.extend("a", ["h0"], 0) == 1 and active.extend("a", ["h1"], 0) == 0
    now[0] = 8.0
    assert active.count("a") == 0


def test_each_replica_keeps_at_most_its_bound_dropping_the_oldest():
    active, _ = make(max_per_replica=3)
    active.add("a", ["h0", "h1", "h2", "h3", "h4"])
    assert active.count("a") == 3
    assert active.extend("a", ["h2", "h3", "h4"], 0) == 3 and active.extend("a", ["h1"], 0) == 0


def test_confirmed_blocks_stop_counting_and_forget_drops_a_replica():
    active, _ = make()
    active.add("a", ["h0", "h1", "h2"])
    active.add("b", ["h0"])
    active.confirm("a", ["h1", "unknown"])
    assert active.count("a") == 2 and active.count("b") == 1
    active.forget("b")
    assert active.count("b") == 0 and active.replicas() == ["a"]


def test_extend_counts_the_pending_run_from_where_the_match_stopped():
    active, _ = make()
    hashes = ["h0", "h1", "h2", "h3", "h4"]
    active.add("a", ["h2", "h3"])                   # h0, h1 cached; h2, h3 sent; h4 not
    assert active.extend("a", hashes, 2) == 2
    assert active.extend("a", hashes, 0) == 0       # h0 is not pending: the run is empty
    assert active.extend("a", hashes, 3) == 1
    assert active.extend("b", hashes, 2) == 0


def test_with_active_extends_a_match_by_the_blocks_pending_right_after_it():
    active, _ = make()
    hashes = ["h0", "h1", "h2", "h3", "h4"]
    active.add("a", ["h2", "h3"])
    cached = MatchInfo(blocks=2, device_blocks=1, host_blocks=1)
    assert with_active(cached, active, "a", hashes) == MatchInfo(4, 3, 1)   # computed on device
    assert with_active(MatchInfo(1, 1, 0), active, "a", hashes) == MatchInfo(1, 1, 0)  # h1 missing
    active.add("b", ["h0", "h1"])
    assert with_active(None, active, "b", hashes) == MatchInfo(2, 2, 0)
    assert with_active(None, active, "c", hashes) is None


def test_routing_history_matches_every_prompt_it_recorded_until_forgotten():
    history = RoutingHistory()
    assert history.empty()
    history.record("a", ["h0", "h1"])
    history.record("a", ["h0", "h1", "h2"])         # each record is the replica's next batch
    history.record("b", ["h0"])
    got = history.index.match(["h0", "h1", "h2"], touch=False)
    assert got["a"].blocks == 3 and got["b"].blocks == 1
    history.forget("a")
    history.record("a", ["h5"])                     # a replica that came back starts again
    assert history.index.match(["h5"], touch=False)["a"].blocks == 1
    assert history.index.match(["h0", "h1"], touch=False).keys() == {"b"}
