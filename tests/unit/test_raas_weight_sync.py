"""WeightSync: full and delta versions reach the engine exactly, verified, off the generation path.

Artifacts are real (astralight.weights.artifacts.ArtifactBuilder); the weight store is an
in-memory fake of the DataflowClient's weight routes, and the engine records what it was given.
"""

from __future__ import annotations

import threading

import pytest
import torch

from astralight.raas.weight_sync import WeightSync
from astralight.weights.artifacts import ArtifactBuilder
from tests.fakes import FakeStore
from tests.unit.raas_fakes import states as _states


class RecordingEngine:
    def __init__(self, version=0):
        self.version = version
        self.loaded = []  # (version, {name: tensor copy}, thread name)

    def update_weights(self, named_tensors, version):
        self.loaded.append((version, {k: v.clone() for k, v in named_tensors.items()},
                            threading.current_thread().name))
        self.version = version


def _assert_loaded(engine, version, state):
    v, tensors, _ = engine.loaded[-1]
    assert v == version == engine.version
    assert set(tensors) == set(state)
    for k, t in state.items():
        assert tensors[k].dtype == torch.bfloat16
        assert torch.equal(tensors[k], t.to(torch.bfloat16))


def test_full_then_deltas_each_reach_the_engine_exactly():
    store, builder, engine = FakeStore(), ArtifactBuilder("policy", full_every=10), RecordingEngine()
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.0, background=False)
    assert sync.refresh() is None and engine.loaded == []  # nothing published yet
    for version, state in enumerate(_states(3), start=1):
        store.add(builder.build(version, state))
        assert store.manifests[version].kind == ("full" if version == 1 else "delta")
        pause = sync.refresh()
        assert pause is not None and pause >= 0
        _assert_loaded(engine, version, state)
    assert sync.refreshes == 3
    assert sync.refresh() is None  # already current: nothing downloaded or loaded again
    assert len(engine.loaded) == 3


def test_a_newcomer_walks_back_to_the_last_full_version():
    store, builder = FakeStore(), ArtifactBuilder("policy", full_every=10)
    states = _states(4)
    for version, state in enumerate(states, start=1):
        store.add(builder.build(version, state))
    engine = RecordingEngine()
    sync = WeightSync(lambda: store, "policy", engine, background=False)
    sync.refresh()
    assert [v for v, _ in store.downloads] == [1, 2, 3, 4]
    assert len(engine.loaded) == 1  # one load of the final state, not one per version
    _assert_loaded(engine, 4, states[-1])


def test_a_corrupt_delta_falls_back_to_a_full_pull_at_once_and_is_counted(caplog):
    store, builder = FakeStore(), ArtifactBuilder("policy", full_every=10)
    states = _states(2)
    store.add(builder.build(1, states[0]))
    engine = RecordingEngine()
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.0, background=False)
    sync.refresh()
    _assert_loaded(engine, 1, states[0])
    store.add(builder.build(2, states[1]))
    store.corrupt_once.add((2, "delta.bin"))  # damaged on the wire once
    store.downloads.clear()
    sync.refresh()
    # the delta failed its check, the full route (v1 full + v2 delta) was pulled right away
    assert [v for v, _ in store.downloads] == [2, 1, 2]
    assert sync.full_fallbacks == 1 and sync.failures == 0
    _assert_loaded(engine, 2, states[1])
    assert len(engine.loaded) == 2  # the corrupt bytes never reached the engine
    assert any("falling back to a full pull" in r.getMessage() and "sha256" in r.getMessage()
               for r in caplog.records)


def test_a_persistently_corrupt_delta_keeps_the_engine_on_its_version_until_a_new_full():
    store, builder = FakeStore(), ArtifactBuilder("policy", full_every=10)
    states = _states(4)
    store.add(builder.build(1, states[0]))
    engine = RecordingEngine()
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.0, background=False,
                      min_backoff_s=600.0, max_backoff_s=600.0)
    sync.refresh()
    store.add(builder.build(2, states[1]))
    store.corrupt.add((2, "delta.bin"))  # damaged in the store: every route to v2 fails
    store.downloads.clear()
    assert sync.refresh() is None
    assert sync.full_fallbacks == 1 and sync.failures == 1
    assert engine.version == 1 and len(engine.loaded) == 1
    assert "sha256" in sync.last_error
    # backing off: an immediate retry of the same version downloads nothing
    n = len(store.downloads)
    sync.refresh()
    assert len(store.downloads) == n and sync.failures == 1
    # a newer full version resets the backoff and is reached (then deltas follow again)
    store.add(builder.build(3, states[2], full=True))
    store.downloads.clear()
    sync.refresh()
    _assert_loaded(engine, 3, states[2])
    assert store.downloads == [(3, "model.safetensors")]
    store.add(builder.build(4, states[3]))
    store.downloads.clear()
    sync.refresh()
    _assert_loaded(engine, 4, states[3])
    assert store.downloads == [(4, "delta.bin")]


def test_a_delta_route_heavier_than_the_full_route_is_skipped():
    """Far behind on large deltas: the last full version plus the deltas after it is cheaper."""
    g = torch.Generator().manual_seed(0)
    store, builder = FakeStore(), ArtifactBuilder("policy", full_every=3)
    state = {"w": torch.randn(64, 64, generator=g)}
    versions = []
    for v in range(1, 6):  # 1 full, 2-3 deltas (every element changes), 4 full, 5 delta
        state = {"w": state["w"] + torch.randn(64, 64, generator=g)}
        store.add(builder.build(v, state))
        versions.append(state)
    assert [store.manifests[v].kind for v in range(1, 6)] == ["full", "delta", "delta", "full", "delta"]
    engine = RecordingEngine()
    sync = WeightSync(lambda: store, "policy", engine, background=False)
    sync.state.apply(store.manifests[1], {n: store.files[(1, n)] for n in store.manifests[1].files})
    store.downloads.clear()
    sync.refresh()
    _assert_loaded(engine, 5, versions[-1])
    assert [v for v, _ in store.downloads] == [4, 5]  # not 2, 3, 4(full), 5


def test_background_thread_verifies_and_only_apply_ready_loads():
    store, builder = FakeStore(), ArtifactBuilder("policy")
    states = _states(1)
    store.add(builder.build(1, states[0]))
    engine = RecordingEngine()
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.01, background=True)
    sync.start()
    try:
        for _ in range(500):
            if sync.state.version == 1:
                break
            threading.Event().wait(0.01)
        assert sync.state.version == 1
        assert engine.loaded == []  # prepared, not yet loaded: generation is not disturbed
        assert sync.apply_ready() is not None
    finally:
        sync.close()
    _assert_loaded(engine, 1, states[0])
    assert engine.loaded[0][2] == threading.current_thread().name


@pytest.mark.parametrize("versions", [1, 2])  # a full version, a delta chain
def test_a_wrong_model_id_is_refused(versions):
    store, builder = FakeStore(), ArtifactBuilder("other", full_every=10)
    for version, state in enumerate(_states(versions), start=1):
        store.add(builder.build(version, state))
    engine = RecordingEngine()
    sync = WeightSync(lambda: store, "policy", engine, background=False)
    sync.refresh()
    assert engine.loaded == [] and sync.failures == 1


def test_importing_the_raas_does_not_import_vllm():
    import subprocess
    import sys

    code = ("import sys, astralight.raas.service, astralight.raas.vllm_engine, "
            "astralight.raas.weight_sync, astralight.raas.hf_engine, "
            "astralight.workflows.single_turn; "
            "assert 'vllm' not in sys.modules, 'vllm imported'; "
            "assert 'lightning' not in sys.modules and 'pytorch_lightning' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


class PartialEngine(RecordingEngine):
    """Takes whole fused modules, like VLLMEngine."""

    def __init__(self, version=0):
        super().__init__(version)
        self.partial_flags = []

    def weight_update_names(self, changed, all_names):
        from astralight.raas.weight_groups import expand_to_modules

        return expand_to_modules(changed, all_names)

    def update_weights(self, named_tensors, version, partial=False):
        self.partial_flags.append(partial)
        super().update_weights(named_tensors, version)


def _qwen_like_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    names = ["model.embed_tokens.weight"]
    for i in range(2):
        p = f"model.layers.{i}."
        names += [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                  p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight",
                  p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight",
                  p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
    names += ["model.norm.weight", "lm_head.weight"]
    return {n: torch.randn(4, 8, generator=g) for n in names}


def test_only_changed_modules_are_pushed_with_their_fused_partners():
    store, builder = FakeStore(), ArtifactBuilder("policy", full_every=3)
    engine = PartialEngine()
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.0, background=False)
    state = _qwen_like_state()
    store.add(builder.build(1, state))
    sync.refresh()
    assert len(engine.loaded[-1][1]) == len(state) and engine.partial_flags == [False]

    state = {k: v.clone() for k, v in state.items()}
    state["model.layers.1.self_attn.k_proj.weight"][0, 0] += 1.0  # one element of one shard
    state["model.layers.0.self_attn.q_norm.weight"][1, 2] += 1.0
    store.add(builder.build(2, state))
    assert store.manifests[2].kind == "delta"
    sync.refresh()
    _, pushed, _ = engine.loaded[-1]
    assert sorted(pushed) == sorted(["model.layers.1.self_attn.q_proj.weight",
                                     "model.layers.1.self_attn.k_proj.weight",
                                     "model.layers.1.self_attn.v_proj.weight",
                                     "model.layers.0.self_attn.q_norm.weight"])
    assert engine.partial_flags[-1] is True and engine.version == 2
    for name, t in pushed.items():
        assert torch.equal(t, state[name].to(torch.bfloat16))

    # a periodic full version that changes only one MLP shard pushes only that module
    state = {k: v.clone() for k, v in state.items()}
    state["model.layers.0.mlp.up_proj.weight"][3, 7] -= 2.0
    store.add(builder.build(3, state, full=True))
    assert store.manifests[3].kind == "full"
    sync.refresh()
    assert sorted(engine.loaded[-1][1]) == ["model.layers.0.mlp.gate_proj.weight",
                                            "model.layers.0.mlp.up_proj.weight"]
    assert sync.partial_pushes == 2 and sync.refreshes == 3
    assert sync.tensors_pushed == len(state) + 4 + 2


def test_a_failed_engine_load_makes_the_next_push_send_everything():
    store, builder = FakeStore(), ArtifactBuilder("policy")
    engine = PartialEngine()
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.0, background=False)
    state = _qwen_like_state()
    store.add(builder.build(1, state))
    sync.refresh()
    state = {k: v.clone() for k, v in state.items()}
    state["model.norm.weight"] += 1.0
    store.add(builder.build(2, state))
    real = engine.update_weights
    engine.update_weights = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("engine hiccup"))
    with pytest.raises(RuntimeError, match="engine hiccup"):
        sync.refresh()
    engine.update_weights = real
    assert sync.refresh() is None  # backing off after the failed load
    sync.refresh(force=True)  # (forced: no backoff)
    assert engine.version == 2 and len(engine.loaded[-1][1]) == len(state)


def test_large_files_are_streamed_to_disk_and_removed_after_use(tmp_path):
    store, builder = FakeStore(), ArtifactBuilder("policy", full_every=10)
    states = _states(2)
    engine = RecordingEngine()
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.0, background=False,
                      download_dir=tmp_path / "dl", stream_min_bytes=0)
    for version, state in enumerate(states, start=1):
        store.add(builder.build(version, state))
        sync.refresh()
        _assert_loaded(engine, version, state)
    assert [p.name for p in store.streamed] == ["policy-1-model.safetensors", "policy-2-delta.bin"]
    assert list((tmp_path / "dl").iterdir()) == []
    sync.close()
    assert (tmp_path / "dl").exists()  # a folder it was given is not removed


def test_apply_ready_never_waits_for_the_thread():
    store, builder = FakeStore(), ArtifactBuilder("policy")
    store.add(builder.build(1, _states(1)[0]))
    engine = RecordingEngine()
    sync = WeightSync(lambda: store, "policy", engine, background=True)
    sync.check(store)
    assert sync.state.version == 1
    with sync._lock:  # the thread is applying a version right now
        assert sync.apply_ready() is None
    assert engine.loaded == []
    assert sync.apply_ready() is not None and engine.version == 1


def test_expand_to_modules_groups_fused_shards_and_keeps_order():
    from astralight.raas.weight_groups import engine_module, expand_to_modules

    names = list(_qwen_like_state())
    assert engine_module("model.layers.0.self_attn.v_proj.weight") == "model.layers.0.self_attn.qkv_proj"
    assert engine_module("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj"
    assert expand_to_modules(["model.layers.0.mlp.up_proj.weight", "lm_head.weight"], names) == [
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    assert expand_to_modules([], names) == []
    with pytest.raises(KeyError, match="nope"):
        expand_to_modules(["nope.weight"], names)
    # weight and bias of one module travel together
    assert expand_to_modules(["a.q_proj.bias"], ["a.q_proj.weight", "a.q_proj.bias", "a.k_proj.bias",
                                                 "a.o_proj.weight"]) == [
        "a.q_proj.weight", "a.q_proj.bias", "a.k_proj.bias"]


def test_a_version_the_engine_fails_to_load_is_retried_with_backoff_not_every_call():
    class Failing(RecordingEngine):
        fail = True

        def update_weights(self, named_tensors, version):
            self.attempts = getattr(self, "attempts", 0) + 1
            if self.fail:
                raise RuntimeError("engine refused the load")
            super().update_weights(named_tensors, version)

    store, engine = FakeStore(), Failing()
    store.add(ArtifactBuilder("policy").build(1, _states(1)[0]))
    sync = WeightSync(lambda: store, "policy", engine, background=False, check_interval_s=0.0,
                      min_backoff_s=3600.0)
    with pytest.raises(RuntimeError, match="refused the load"):
        sync.refresh()
    for _ in range(5):  # the refresh loop calls again and again: no new attempt while backing off
        assert sync.refresh() is None
    assert engine.attempts == 1 and sync.failures == 1 and "refused" in sync.last_error
    engine.fail = False
    assert sync.refresh(force=True) is not None and engine.version == 1  # forced: tries at once
