"""tenants.yaml -> one engine: a reload's pinned-region resize runs after removed prefixes are
released, is retried until complete, and the region follows premium demand within bounds."""

from __future__ import annotations

import logging
import os
import random

import pytest
import yaml

from kvharbor.actors.tenant_sync import TenantSync
from kvharbor.config import EngineConfig
from kvharbor.engine.engine import Engine
from kvharbor.engine.request import SamplingParams


def _write(path, edit) -> None:
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))      # a visible change


def _engine(sync: TenantSync, **kwargs) -> Engine:
    engine = Engine(sync.apply_to_config(EngineConfig(device="cpu", num_kv_blocks=96, **kwargs)))
    sync.pin_prefixes(engine)
    return engine


def _reserve(blocks: int, prefixes: list[str] | None = None):
    def edit(data):
        data["tenants"]["acme"]["pinned_kv_blocks"] = blocks
        if prefixes is not None:
            data["tenants"]["acme"]["pinned_prefixes"] = prefixes
    return edit


def _premium_peak(engine: Engine, seed: int) -> int:
    """Run 3 premium requests of 150 random tokens + 8 generated (~30 blocks of demand) to the
    end, checking the pool's integrity each step; the pinned region's largest size meanwhile."""
    rng = random.Random(seed)
    for i in range(3):
        engine.add_request(f"p{i}", [rng.randrange(256) for _ in range(150)],
                           SamplingParams(max_tokens=8, ignore_eos=True), qos="premium")
    peak = 0
    for _ in range(40):
        engine.step()
        peak = max(peak, engine.pool.num_pinned)
        engine.check_integrity()
    assert not engine.has_unfinished()
    return peak


def test_reload_releases_removed_prefixes_before_shrinking(tenants_file):
    _write(tenants_file, _reserve(16))
    sync = TenantSync(str(tenants_file))
    engine = _engine(sync)
    pool = engine.pool
    assert pool.num_pinned == 16 and pool.region_counts("pinned")["permanent"] > 0
    _write(tenants_file, _reserve(0, prefixes=[]))           # prefix and reservation removed
    assert sync.maybe_reload(engine)
    assert pool.num_pinned == 0, "the resize ran while the removed prefix still held its blocks"
    assert engine.pinned_prefixes == []
    engine.check_integrity()


def test_a_prefix_that_finds_no_room_is_logged_and_the_others_stay_pinned(tenants_file, caplog):
    """Two pinned prompts, a region that holds only the first: the replica starts, serves the
    first from the region and logs why the second is not pinned (and what to raise)."""
    long, short = " ".join(["word"] * 300), "You are a helpful assistant."
    _write(tenants_file, _reserve(2, prefixes=[long, short]))
    sync = TenantSync(str(tenants_file))
    with caplog.at_level(logging.ERROR, logger="kvharbor.replica"):
        engine = _engine(sync)
    assert [text for _, text, _, _ in sync.pinned] == [long] and len(engine.pinned_prefixes) == 1
    assert "cannot pin prefix of tenant acme: no room to pin" in caplog.text, caplog.text
    assert "raise pinned_kv_blocks" in caplog.text
    engine.check_integrity()


def test_a_resize_that_stops_short_is_retried_until_complete(tenants_file, caplog):
    """The region's resize moves only free blocks; the replica's tick retries it (logging how
    far it got) until the region has its target size. An unchanged file is not applied again."""
    _write(tenants_file, _reserve(8, prefixes=[]))
    sync = TenantSync(str(tenants_file))
    engine = _engine(sync)
    rng = random.Random(0)
    engine.add_request("hog", [rng.randrange(256) for _ in range(950)], SamplingParams(max_tokens=4),
                       qos="standard")
    engine.step()                                            # holds 60 of the 88 shared blocks
    _write(tenants_file, _reserve(40, prefixes=[]))
    with caplog.at_level(logging.INFO, logger="kvharbor.replica"):
        assert sync.maybe_reload(engine)
    assert engine.pool.num_pinned < 40                       # only free blocks move
    assert f"pinned region is {engine.pool.num_pinned} blocks, target 40 (blocks busy; retrying)" \
        in caplog.text, caplog.text
    for _ in range(10):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    # The step that finished hog freed its blocks after that step's resize: the engine is idle
    # now and no step will come, so only the replica's once-a-second tick can finish the job.
    assert engine.pool.num_pinned < 40
    assert not sync.maybe_reload(engine)                     # no change in the file: a retry tick
    assert engine.pool.num_pinned == 40
    engine.check_integrity()


def test_region_grows_with_premium_demand_and_shrinks_back_to_its_floor(tenants_file):
    def bounds(data):
        _reserve(4, prefixes=[])(data)
        data["pinned_region"] = {"floor_blocks": 4, "ceiling_blocks": 48, "demand_window_s": 1.0}
    _write(tenants_file, bounds)
    sync = TenantSync(str(tenants_file))
    engine = _engine(sync)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    engine.scheduler.sizer.shrink_after_s = 1.0
    peak = _premium_peak(engine, seed=1)
    assert 30 <= peak <= 48, f"region peaked at {peak} blocks for ~30 blocks of premium demand"
    for t in (5.0, 6.5):                                     # window over, then the shrink delay
        now[0] = t
        engine.resize_pinned_region()
    assert engine.pool.num_pinned == 4
    engine.check_integrity()


def _engine_with_acmes_prefix(tenants_file, ceiling: int) -> tuple[Engine, TenantSync, str]:
    """acme pins a 128-character prefix (8 blocks); the region floats from 8 blocks up to
    ``ceiling`` over a 10 s window."""
    prefix = "".join(chr(97 + i % 26) for i in range(128))
    def bounds(data):
        _reserve(8, prefixes=[prefix])(data)
        data["pinned_region"] = {"floor_blocks": 8, "ceiling_blocks": ceiling, "demand_window_s": 10.0}
    _write(tenants_file, bounds)
    sync = TenantSync(str(tenants_file))
    engine = _engine(sync)
    assert engine.pool.permanent["pinned"] == 8
    return engine, sync, prefix


def test_pinned_prefixes_count_in_the_premium_demand_the_region_is_sized_for(tenants_file):
    """The region holds acme's pinned prefix (8 blocks) and the premium requests beside it:
    three 10-block requests that share nothing with the prefix make a demand of 38 blocks,
    so the region grows to the ceiling (38 x 1.25 headroom = 48), not to the 38 blocks the
    requests alone would ask for."""
    engine, _, _ = _engine_with_acmes_prefix(tenants_file, ceiling=48)
    rng = random.Random(2)
    for i in range(3):
        engine.add_request(f"p{i}", [rng.randrange(200, 256) for _ in range(150)],
                           SamplingParams(max_tokens=8, ignore_eos=True), qos="premium")
    peak = 0
    for _ in range(40):
        engine.step()
        peak = max(peak, engine.pool.num_pinned)
    assert not engine.has_unfinished()
    assert peak == 48, f"region peaked at {peak} blocks for 8 prefix + 30 request blocks"


def test_premium_requests_that_hit_the_pinned_prefix_count_its_blocks_once(tenants_file):
    """Three premium requests of acme start with its pinned prefix (8 full blocks of its 140
    tokens, hit) and add 10 blocks each (138 tokens more, 8 generated): 38 distinct blocks,
    so the region grows to ceil(38 x 1.25) = 48, below the ceiling (80). Counting each
    request's whole block table would make 8 + 3 x 18 = 62 and grow the region to 78 blocks
    the premium work never uses."""
    from kvharbor.actors.replica_sync import system_prompt_tokens

    engine, sync, prefix = _engine_with_acmes_prefix(tenants_file, ceiling=80)
    system = system_prompt_tokens(engine.tokenizer, prefix)
    assert len(system) == 140                                       # a chat turn around it
    rng = random.Random(3)
    for i in range(3):
        engine.add_request(f"p{i}", system + [rng.randrange(200, 256) for _ in range(138)],
                           SamplingParams(max_tokens=8, ignore_eos=True), tenant="acme",
                           qos="premium", cache_salt=sync.registry.cache_salt("acme"))
    peak, cached = 0, {}
    for _ in range(40):
        for out in engine.step():
            cached.setdefault(out.request_id, out.num_cached_tokens)
        peak = max(peak, engine.pool.num_pinned)
        engine.check_integrity()
    assert not engine.has_unfinished()
    assert cached == {"p0": 128, "p1": 128, "p2": 128}, "the requests must hit the prefix"
    assert peak == 48, f"region peaked at {peak} blocks for 8 prefix + 30 request blocks"


def test_the_engine_takes_each_class_and_the_regions_floor_from_tenants_yaml(tenants_file):
    def edit(data):
        _reserve(4)(data)
        data["qos_classes"]["premium"].update(ttft_slo_ms=100, step_target_ms=20)
        data["pinned_region"] = {"floor_blocks": 12}
    _write(tenants_file, edit)
    sync = TenantSync(str(tenants_file))
    engine = _engine(sync)
    classes = sync.registry.config.qos_classes
    assert any(not q.preemptible for q in classes.values()), "the check needs a class that is not"
    for name, q in classes.items():
        spec = engine.config.qos_classes[name]
        assert (spec.priority, spec.pinned, spec.preemptible, spec.ttft_slo_ms, spec.step_target_ms) \
            == (q.priority, q.pinned, q.preemptible, q.ttft_slo_ms, q.step_target_ms), name
    assert engine.pool.num_pinned == 12           # the region's floor beats the reservations (4)


def test_a_tenants_pinned_prompt_is_pinned_in_that_tenants_cache_scope(tenants_file):
    """The prefix is pinned under the tenant's cache salt, so the tenant's own requests (which
    carry that salt) hit it."""
    from kvharbor.actors.replica_sync import system_prompt_tokens

    _write(tenants_file, _reserve(16))
    sync = TenantSync(str(tenants_file))
    engine = _engine(sync)
    system = system_prompt_tokens(engine.tokenizer, sync.registry.config.tenants["acme"].pinned_prefixes[0])
    engine.add_request("turn", system + [5] * 20, SamplingParams(max_tokens=1), tenant="acme",
                       qos="premium", cache_salt=sync.registry.cache_salt("acme"))
    out = next(o for o in engine.step() if o.request_id == "turn")
    assert out.num_cached_tokens == len(system) // 16 * 16 > 0


def test_a_pinned_prompt_follows_its_tenant_into_a_new_cache_scope(tenants_file):
    """acme moves from its private scope to the public one: its pinned prompt is pinned again
    under the new scope's hashes (its requests, which now carry no salt, hit it) and the old
    copy is released, not left holding pinned blocks no request can reach."""
    from kvharbor.actors.replica_sync import system_prompt_tokens

    _write(tenants_file, _reserve(16))
    sync = TenantSync(str(tenants_file))
    engine = _engine(sync)
    held = engine.pool.region_counts("pinned")["permanent"]
    _write(tenants_file, lambda data: data["tenants"]["acme"].update(cache_scope="public"))
    assert sync.maybe_reload(engine)
    assert sync.registry.cache_salt("acme") is None
    assert len(engine.pinned_prefixes) == 1
    assert engine.pool.region_counts("pinned")["permanent"] == held
    system = system_prompt_tokens(engine.tokenizer, sync.registry.config.tenants["acme"].pinned_prefixes[0])
    engine.add_request("turn", system + [5] * 20, SamplingParams(max_tokens=1), tenant="acme",
                       qos="premium", cache_salt=None)
    out = next(o for o in engine.step() if o.request_id == "turn")
    assert out.num_cached_tokens == len(system) // 16 * 16 > 0
    engine.check_integrity()


def test_a_reload_reaches_the_classes_sessions_region_bounds_and_prefixes(tenants_file):
    def before(data):
        _reserve(4)(data)
        data["pinned_region"] = {"floor_blocks": 4, "ceiling_blocks": 48, "demand_window_s": 5.0}
    _write(tenants_file, before)
    sync = TenantSync(str(tenants_file))
    engine = _engine(sync)
    assert len(engine.pinned_prefixes) == 1
    priority = sync.registry.config.qos_classes["batch"].priority

    def after(data):
        data["qos_classes"]["batch"]["priority"] = priority + 1
        data["tenants"]["acme"]["session_ttl_s"] = 7.0
        data["tenants"]["acme"]["pinned_prefixes"].append("A second system prompt for Acme.")
        data["pinned_region"] = {"floor_blocks": 4, "demand_window_s": 2.0}   # no ceiling now
    _write(tenants_file, after)
    assert sync.maybe_reload(engine)
    assert engine.config.qos_classes["batch"].priority == priority + 1
    assert engine.sessions.limits_for("acme").ttl_s == 7.0
    sizer = engine.scheduler.sizer
    assert sizer.window_s == 2.0 and sizer.ceiling is None     # the engine's config sets none
    assert len(engine.pinned_prefixes) == 2       # the new prompt pinned, the old one not again
    engine.check_integrity()


@pytest.mark.parametrize("own_ceiling", [None, 20])
def test_a_reload_that_drops_the_ceiling_gives_the_engines_own_back(tenants_file, own_ceiling):
    """tenants.yaml set ceiling_blocks 48 at start; a reload without it leaves the engine's own
    ceiling (build_app's pinned_kv_blocks_max), as a start without it would: none, a region
    fixed at its floor that premium demand no longer grows; or 20. (The reload kept the 48
    tenants.yaml had set.)"""
    def bounded(data):
        _reserve(4, prefixes=[])(data)
        data["pinned_region"] = {"floor_blocks": 4, "ceiling_blocks": 48, "demand_window_s": 1.0}
    _write(tenants_file, bounded)
    sync = TenantSync(str(tenants_file))
    engine = _engine(sync, pinned_kv_blocks_max=own_ceiling)
    assert engine.scheduler.sizer.ceiling == 48
    _write(tenants_file, lambda data: data["pinned_region"].pop("ceiling_blocks"))
    assert sync.maybe_reload(engine)
    peak = _premium_peak(engine, seed=4)
    assert peak == (4 if own_ceiling is None else 20), f"region peaked at {peak} blocks"
    engine.check_integrity()


def _adapters(entries: dict):
    def edit(data):
        data["lora_adapters"] = {name: {"path": path} for name, path in entries.items()}
    return edit


def _answer(engine: Engine, rid: str, lora: str) -> list[int]:
    engine.add_request(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       lora=lora)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs[-1].token_ids


def test_tenants_yaml_adapters_are_loaded_replaced_and_removed(tenants_file, tmp_path, caplog):
    """lora_adapters in tenants.yaml (a relative path read from the file's directory): loaded
    at start; a new path under the same name serves the new checkpoint (in a new cache scope);
    removed, no longer served; build_app's lora_modules stay whatever the file says."""
    from tests.conftest import write_test_adapter

    one = write_test_adapter(tenants_file.parent / "one", seed=1)
    two = write_test_adapter(tmp_path / "two", seed=2)
    _write(tenants_file, _adapters({"hot": "one"}))
    sync = TenantSync(str(tenants_file))
    engine = Engine(sync.apply_to_config(EngineConfig(device="cpu", num_kv_blocks=96,
                                                      lora_modules={"static": two})))
    with caplog.at_level(logging.INFO, logger="kvharbor.replica"):
        sync.sync_adapters(engine)
    assert {n: a.path for n, a in engine.loras.adapters.items()} == {"static": two, "hot": one}
    assert f"LoRA adapter hot loaded from {one}" in caplog.text, caplog.text
    loaded = engine.loras.adapters["hot"]
    sync.sync_adapters(engine)                               # nothing changed: not loaded again
    assert engine.loras.adapters["hot"] is loaded
    first = _answer(engine, "a", "hot")
    assert first != _answer(engine, "b", "static")
    _write(tenants_file, _adapters({"hot": two, "static": one}))  # hot -> two's weights
    assert sync.maybe_reload(engine)
    sync.sync_adapters(engine)
    assert {n: a.path for n, a in engine.loras.adapters.items()} == {"static": two, "hot": two}
    again = engine.add_request("c", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0), lora="hot")
    assert again.cache_salt.endswith("@" + two)          # not the blocks hot cached from one
    while engine.has_unfinished():
        out = engine.step()
    assert out[-1].token_ids == _answer(engine, "d", "static") != first
    _write(tenants_file, _adapters({}))
    assert sync.maybe_reload(engine)
    with caplog.at_level(logging.INFO, logger="kvharbor.replica"):
        sync.sync_adapters(engine)
    assert list(engine.loras.adapters) == ["static"]
    assert "LoRA adapter hot is no longer served (removed from tenants.yaml)" in caplog.text
    engine.check_integrity()


def test_a_request_for_a_just_added_adapter_loads_it_and_a_broken_one_says_why(tenants_file, tmp_path, caplog):
    """The request, and the replica's log, say why an adapter could not be loaded."""
    from tests.conftest import write_test_adapter

    sync = TenantSync(str(tenants_file))
    engine = _engine(sync)
    good = write_test_adapter(tmp_path / "good", seed=3)
    broken = tmp_path / "broken"
    write_test_adapter(broken, seed=4)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    _write(tenants_file, _adapters({"new": good, "bad": str(broken)}))
    sync.ensure_adapter(engine, "new")                  # before the registry's own reload
    assert engine.loras.adapters["new"].path == good and sync.registry.lora_adapters() == {}
    assert sync.maybe_reload(engine)                    # the reload still applies the edit
    with caplog.at_level(logging.ERROR, logger="kvharbor.replica"):
        sync.sync_adapters(engine)
    assert "bad" not in engine.loras.adapters
    assert "cannot load LoRA adapter bad:" in caplog.text, caplog.text
    try:
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), lora="bad")
    except ValueError as e:
        assert "LoRA adapter 'bad' could not be loaded" in str(e)
    else:
        raise AssertionError("a request for an adapter that failed to load was accepted")
    tenants_file.write_text("tenants: [half saved")          # an edit caught mid-write
    sync.ensure_adapter(engine, "later")                     # nothing to read: not loaded, no error
    assert "later" not in engine.loras.adapters
