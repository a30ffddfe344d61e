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


class FakeStore:
    """The weight half of DataflowClient, in memory. ``corrupt`` names files served damaged."""

    def __init__(self):
        self.manifests, self.files, self.corrupt = {}, {}, set()
        self.downloads = []

    def add(self, artifact):
        m = artifact.manifest
        self.manifests[m.version] = m
        for name, data in artifact.files.items():
            self.files[(m.version, name)] = data

    def latest_manifest(self, model_id):
        return self.manifests[max(self.manifests)] if self.manifests else None

    def manifest(self, model_id, version):
        return self.manifests[version]

    def download_weight_file(self, model_id, version, name):
        self.downloads.append((version, name))
        data = self.files[(version, name)]
        return data[:-1] + bytes([data[-1] ^ 1]) if (version, name) in self.corrupt else data

    def close(self):
        pass


class RecordingEngine:
    def __init__(self, version=0):
        self.version = version
        self.loaded = []  # (version, {name: tensor copy}, thread name)

    def update_weights(self, named_tensors, version):
        self.loaded.append((version, {k: v.clone() for k, v in named_tensors.items()},
                            threading.current_thread().name))
        self.version = version


def _states(n, seed=0):
    """n successive small states, each changing a few elements (like RL steps)."""
    g = torch.Generator().manual_seed(seed)
    state = {"a.weight": torch.randn(8, 16, generator=g), "b.bias": torch.randn(16, generator=g)}
    out = []
    for _ in range(n):
        state = {k: v.clone() for k, v in state.items()}
        state["a.weight"][0, :3] += 0.5
        out.append(state)
    return out


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


def test_a_corrupt_download_never_reaches_the_engine_and_a_full_version_is_pulled_next():
    store, builder = FakeStore(), ArtifactBuilder("policy", full_every=10)
    states = _states(2)
    store.add(builder.build(1, states[0]))
    engine = RecordingEngine()
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.0, background=False)
    sync.refresh()
    _assert_loaded(engine, 1, states[0])
    store.add(builder.build(2, states[1]))
    store.corrupt.add((2, "delta.bin"))
    store.downloads.clear()
    assert sync.refresh() is None
    assert engine.version == 1 and len(engine.loaded) == 1 and sync.failures == 1
    store.corrupt.clear()
    sync.refresh()
    _assert_loaded(engine, 2, states[1])
    # the held state was dropped after the failure, so the retry rebuilt from the full version 1
    assert [v for v, _ in store.downloads] == [2, 1, 2]


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
