"""WeightPublisher: full at v1, deltas after, full every ``full_every``; bit-exact reconstruction
by the receiver's WeightState; the falls-behind, failure and resume paths; TensorBoard metrics;
LoRA adapters only."""

from __future__ import annotations

import glob
import hashlib
import collections
import threading

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from safetensors.torch import load, load_file

from astralight.callbacks import WeightPublisher, tensor_sha256
from astralight.policy import M2POPolicy
from astralight.weights import WeightState, read_full, to_bf16_bits
from tests.unit.publisher_fit import FlushEachStep, bf16_bits, fit
from tests.fakes import FakeDataflowClient


def files_of(fake, version):
    return {n: d for v, n, d in fake.uploads if v == version}


def replay(fake, ws=None):
    """Apply every manifest the fake dataflow received, in order, as a RaaS would."""
    ws = ws or WeightState()
    states = {}
    for m in fake.manifests:
        ws.apply(m, files_of(fake, m.version))
        states[m.version] = {n: a.copy() for n, a in ws.state.items()}
    return states


def assert_same_bits(got: dict, want: dict):
    assert set(got) == set(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_full_first_then_deltas_full_every_and_bit_exact(tiny_model_dir):
    fake = FakeDataflowClient(tiny_model_dir)
    # url and model_id come from the datamodule / module; fakes need the in-process worker
    publisher = WeightPublisher(full_every=3, worker="thread")
    publisher.client = fake
    flush = FlushEachStep(publisher)
    fit(tiny_model_dir, fake, [publisher, flush], 7, lr=1e-6)  # RL-like lr: ~99% bits unchanged

    assert publisher.dataflow_url == "http://127.0.0.1:9" and publisher.model_id == "policy"
    assert [m.version for m in fake.manifests] == [1, 2, 3, 4, 5, 6, 7]
    assert [m.kind for m in fake.manifests] == ["full", "delta", "delta", "full", "delta", "delta",
                                                "full"]
    assert [m.base_version for m in fake.manifests if m.kind == "delta"] == [1, 2, 4, 5]
    assert publisher.errors == 0 and publisher.replaced == 0
    assert [m.metadata["step"] for m in fake.manifests] == [1, 2, 3, 4, 5, 6, 7]
    # a delta carries only delta.bin; only changed tensors are in it, and it is much smaller
    v2 = fake.manifests[1]
    assert set(v2.files) == {"delta.bin"}
    assert len(files_of(fake, 2)["delta.bin"]) < len(files_of(fake, 1)["model.safetensors"]) / 2

    # the receiver reconstructs exactly the trainer's bf16 weights at every version
    states = replay(fake)
    for version, state in states.items():
        assert_same_bits(state, flush.at_step[version])
    # a newcomer joining at v5 starts from the full v4
    late = WeightState()
    for m in fake.manifests[3:5]:
        late.apply(m, files_of(fake, m.version))
    assert_same_bits(late.state, flush.at_step[5])

    # per-version records: sparsity = fraction of bit-identical elements, sizes, ratio
    hist = list(publisher.history)
    assert [r["version"] for r in hist] == [1, 2, 3, 4, 5, 6, 7]
    assert "sparsity" not in hist[0]  # nothing to compare v1 with
    for r in hist[1:]:
        prev, cur = flush.at_step[r["version"] - 1], flush.at_step[r["version"]]
        same = sum(int(np.count_nonzero(prev[n] == cur[n])) for n in cur)
        assert r["sparsity"] == pytest.approx(same / sum(a.size for a in cur.values()))
    for r in hist:
        assert r["full_bytes"] == 2 * sum(a.size for a in flush.at_step[1].values())
        assert r["compression_ratio"] == pytest.approx(r["full_bytes"] / r["bytes"])
        assert (r["kind"] == 0.0) == ("delta_bytes" in r)
    assert all(r["compression_ratio"] > 5 and r["sparsity"] > 0.9 for r in hist if r["kind"] == 0.0)


def test_full_artifact_is_plain_hf_safetensors(tiny_model_dir):
    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher(full_every=1, worker="thread")
    publisher.client = fake
    policy, _ = fit(tiny_model_dir, fake, [publisher, FlushEachStep(publisher)], 2)
    last = fake.manifests[-1]
    assert last.kind == "full" and last.version == 2
    data = files_of(fake, 2)["model.safetensors"]
    assert last.files["model.safetensors"] == {"sha256": hashlib.sha256(data).hexdigest(),
                                               "bytes": len(data)}
    tensors = load(data)
    state = policy.model.state_dict()
    assert set(tensors) == set(state)  # HF names, nothing tied in the tiny model
    for name, t in tensors.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, state[name].to(torch.bfloat16)), name
        assert last.tensors[name]["sha256"] == tensor_sha256(t)
    assert set(read_full(last, {"model.safetensors": data})) == set(state)


class BlockingUploads(FakeDataflowClient):
    """An upload that blocks until released: the network is 'slow' for as long as the test says."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.started = threading.Event()

    def upload_weight_file(self, model_id, version, name, data):
        self.started.set()
        assert self.release.wait(timeout=120), "upload never released"
        super().upload_weight_file(model_id, version, name, data)


class Observe(pl.Callback):
    """Records, after each step, how many publications had completed; releases at the last one."""

    def __init__(self, fake, last_step):
        self.fake, self.last_step = fake, last_step
        self.seen = []
        self.final = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            assert self.fake.started.wait(timeout=60)  # the worker is now stuck in upload
        self.seen.append((trainer.global_step, len(self.fake.manifests)))
        if trainer.global_step == self.last_step:
            self.final = bf16_bits(pl_module.model)
            self.fake.release.set()


def test_writer_falls_behind_newest_snapshot_replaces_and_goes_as_delta(tiny_model_dir):
    fake = BlockingUploads(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1, worker="thread")
    publisher.client = fake
    observer = Observe(fake, last_step=4)
    fit(tiny_model_dir, fake, [publisher, observer], 4)

    # all four steps ran while the first upload was still blocked
    assert observer.seen == [(1, 0), (2, 0), (3, 0), (4, 0)]
    # v1 was in flight; v2 and v3 were replaced by newer snapshots; v4 went out at fit end
    assert [m.version for m in fake.manifests] == [1, 4]
    assert publisher.replaced == 2 and publisher.last_published_version == 4
    # v4 is a delta from the last *published* version (v1), not from the skipped v3
    assert fake.manifests[1].kind == "delta" and fake.manifests[1].base_version == 1
    assert_same_bits(replay(fake)[4], observer.final)
    assert fake.acks and len(fake.acks) == 4


class FailOnce(FakeDataflowClient):
    """``publish`` of one version fails (e.g. the service was restarting)."""

    def __init__(self, *args, fail_version, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_version = fail_version

    def publish(self, manifest):
        if manifest.version == self.fail_version:
            raise ConnectionError("dataflow unreachable")
        return super().publish(manifest)


def test_failed_publication_makes_the_next_one_full(tiny_model_dir):
    fake = FailOnce(tiny_model_dir, fail_version=2)
    publisher = WeightPublisher(full_every=10, worker="thread")
    publisher.client = fake
    flush = FlushEachStep(publisher)
    fit(tiny_model_dir, fake, [publisher, flush], 4)
    assert publisher.errors == 1 and "version 2" in publisher.last_error
    # v2's delta advanced the builder's base but never reached the dataflow: v3 must not be a
    # delta onto it
    assert [(m.version, m.kind, m.base_version) for m in fake.manifests] == [
        (1, "full", None), (3, "full", None), (4, "delta", 3)]
    states = replay(fake)
    assert_same_bits(states[4], flush.at_step[4])


def test_resume_publishes_full_first_and_skips_versions_the_dataflow_holds(tiny_model_dir, tmp_path):
    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1, full_every=10, worker="thread")
    publisher.client = fake
    _, trainer = fit(tiny_model_dir, fake, [publisher, FlushEachStep(publisher)], 3)
    ckpt = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(ckpt)
    assert [m.kind for m in fake.manifests] == ["full", "delta", "delta"]

    # resume at step 3 with the same dataflow: the in-memory base is gone -> v4 is full
    resumed = WeightPublisher(every_n_steps=1, full_every=10, worker="thread")
    resumed.client = fake
    flush = FlushEachStep(resumed)
    fit(tiny_model_dir, fake, [resumed, flush], 5, ckpt_path=str(ckpt))
    assert [(m.version, m.kind) for m in fake.manifests[3:]] == [(4, "full"), (5, "delta")]
    assert fake.manifests[4].base_version == 4
    assert_same_bits(replay(fake)[5], flush.at_step[5])

    # the same publisher object reloading a checkpoint forgets its base as well
    resumed.load_state_dict(resumed.state_dict())
    assert resumed.state_dict()["last_published_version"] == 5

    # resume from step 3 again while the dataflow already holds v5 (published past the
    # checkpoint): v4 and v5 are skipped, v6 is full
    again = WeightPublisher(every_n_steps=1, full_every=10, worker="thread")
    again.client = fake
    fit(tiny_model_dir, fake, [again, FlushEachStep(again)], 7, ckpt_path=str(ckpt))
    assert again.skipped == 2 and again.errors == 0
    assert [(m.version, m.kind) for m in fake.manifests[5:]] == [(6, "full"), (7, "delta")]


def test_resume_judges_the_skip_on_the_restored_step(tiny_model_dir, tmp_path, caplog):
    """Lightning restores ``global_step`` after ``on_fit_start``: the skip decision and its
    warning must use the checkpoint's step (3), not 0."""
    import logging

    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1, worker="thread")
    publisher.client = fake
    _, trainer = fit(tiny_model_dir, fake, [publisher, FlushEachStep(publisher)], 5)
    ckpt = tmp_path / "step5.ckpt"
    trainer.save_checkpoint(ckpt)
    # pretend the checkpoint is older than the dataflow: rewind it to step 3
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    state["global_step"] = 3
    state["loops"]["fit_loop"]["epoch_loop.manual_optimization.optim_step_progress"]["total"][
        "completed"] = 3
    [key] = [k for k in state["callbacks"] if k.startswith("WeightPublisher")]
    state["callbacks"][key]["last_enqueued_step"] = 3
    torch.save(state, ckpt)
    resumed = WeightPublisher(every_n_steps=1, worker="thread")
    resumed.client = fake
    with caplog.at_level(logging.WARNING):
        fit(tiny_model_dir, fake, [resumed, FlushEachStep(resumed)], 7, ckpt_path=str(ckpt))
    assert "this trainer is at version 3 (step 3)" in caplog.text
    assert resumed.skipped == 2  # versions 4 and 5 are the dataflow's already
    assert [(m.version, m.kind) for m in fake.manifests[5:]] == [(6, "full"), (7, "delta")]


def test_every_n_steps_and_restore(tiny_model_dir):
    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher(model_id="policy", every_n_steps=2, worker="thread")
    publisher.client = fake
    fit(tiny_model_dir, fake, [publisher, FlushEachStep(publisher)], 5)
    assert [m.version for m in fake.manifests] == [1, 2]  # after steps 2 and 4
    assert [m.metadata["step"] for m in fake.manifests] == [2, 4]
    assert [m.kind for m in fake.manifests] == ["full", "delta"]

    restored = WeightPublisher(every_n_steps=2, worker="thread")
    restored.load_state_dict(publisher.state_dict())
    assert restored.last_published_version == 2


def test_metrics_reach_tensorboard_at_the_version_step(tiny_model_dir, tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1, full_every=2, worker="thread")
    publisher.client = fake
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    # flushed each step: the training thread logs each record at the next step end (or fit end)
    fit(tiny_model_dir, fake, [publisher, FlushEachStep(publisher)], 4, logger=logger)
    logger.finalize("success")
    acc = EventAccumulator(glob.glob(str(tmp_path / "tb" / "*" / "events*"))[0])
    acc.Reload()
    published = {r["version"]: r for r in publisher.history}
    steps = sorted(r["step"] for r in published.values())
    assert steps == [1, 2, 3, 4]
    for key in ("kind", "full_bytes", "bytes", "compression_ratio", "latency_s"):
        events = acc.Scalars(f"publish/{key}")
        assert sorted(e.step for e in events) == steps, key
    kinds = {e.step: e.value for e in acc.Scalars("publish/kind")}
    assert kinds[1] == 1.0  # v1 full
    deltas = [r for r in published.values() if r["kind"] == 0.0]
    assert [r["version"] for r in deltas] == [2, 4]  # full_every=2: fulls at 1 and 3
    assert {e.step for e in acc.Scalars("publish/delta_bytes")} == {r["step"] for r in deltas}
    sparsity = {e.step: e.value for e in acc.Scalars("publish/sparsity")}
    for r in deltas:
        assert sparsity[r["step"]] == pytest.approx(r["sparsity"], rel=1e-6)
    assert "publish/errors" in acc.Tags()["scalars"]


class LoRAPolicy(M2POPolicy):
    """The tiny model with a rank-4 LoRA on q/v projections (peft)."""

    def configure_model(self) -> None:
        from peft import LoraConfig, get_peft_model

        if self.model is not None:
            return
        super().configure_model()
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                            lora_dropout=0.0, init_lora_weights=False)
        self.model = get_peft_model(self.model, config)


def test_lora_publishes_adapter_tensors_only(tiny_model_dir, tmp_path):
    from peft import get_peft_model_state_dict

    def adapter_bits(model):
        return {n: to_bf16_bits(t.detach().to(torch.bfloat16))
                for n, t in get_peft_model_state_dict(model).items()}

    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher(full_every=10, worker="thread")
    publisher.client = fake
    flush = FlushEachStep(publisher, weights=adapter_bits)
    policy = LoRAPolicy(str(tiny_model_dir), lr=1e-2)
    fit(tiny_model_dir, fake, [publisher, flush], 2, policy=policy)

    assert [m.kind for m in fake.manifests] == ["full", "delta"]
    policy.model.save_pretrained(str(tmp_path / "adapter"))
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    for m in fake.manifests:
        assert set(m.tensors) == set(saved)  # names exactly as peft saves them
        assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in m.tensors)
        assert m.metadata["adapter"]["type"] == "lora"
        assert m.metadata["adapter"]["peft_config"]["r"] == 4
    # 2 layers x (q, v) x (A, B); no base weight is published
    assert len(fake.manifests[0].tensors) == 8
    assert_same_bits(replay(fake)[2], flush.at_step[2])
    assert any(not np.array_equal(flush.at_step[1][n], flush.at_step[2][n]) for n in saved)



class GatedUploads(FakeDataflowClient):
    """The upload of version ``v`` waits until the trainer has ended step ``v + 1``
    (:class:`OpenGates`): every publication is exactly one step slower than training."""

    def __init__(self, *args, fail_versions=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.gates = collections.defaultdict(threading.Event)
        self.fail_versions = set(fail_versions)

    def upload_weight_file(self, model_id, version, name, data):
        assert self.gates[version + 1].wait(timeout=120), f"gate {version + 1} never opened"
        super().upload_weight_file(model_id, version, name, data)

    def publish(self, manifest):
        if manifest.version in self.fail_versions:
            raise ConnectionError("dataflow unreachable")
        return super().publish(manifest)


class OpenGates(pl.Callback):
    """Opens gate ``s`` 0.2 s after the end of step ``s`` (so the publisher's hook for that step
    runs first and finds version ``s - 1`` unpublished), and every gate at the end of training
    (so the last version goes out at fit end)."""

    def __init__(self, fake):
        self.fake = fake

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        threading.Timer(0.2, self.fake.gates[trainer.global_step].set).start()

    def on_train_end(self, trainer, pl_module):
        for step in range(trainer.global_step + 2):
            self.fake.gates[step].set()


class PublishedAfterStep(pl.Callback):
    """Placed after the publisher: records ``(step, last published version)`` after each step."""

    def __init__(self, publisher):
        self.publisher = publisher
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((trainer.global_step, self.publisher.last_published_version))


def test_max_lag_versions_holds_the_trainer_to_its_publication(tiny_model_dir):
    fake = GatedUploads(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1, worker="thread", max_lag_versions=1)
    publisher.client = fake
    seen = PublishedAfterStep(publisher)
    fit(tiny_model_dir, fake, [OpenGates(fake), publisher, seen], 5)
    # after the step that made version V the trainer waited for version V - 1 (without the
    # wait the hook after the publisher's would see V - 2: V - 1's upload opens 0.2 s later)
    assert seen.seen == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4)]
    assert 1 <= publisher.lag_waits <= 4 and publisher.lag_wait_s > 0.1
    assert publisher.replaced == 0
    assert publisher.last_published_version == 5 and publisher.errors == 0


def test_without_max_lag_versions_the_trainer_does_not_wait(tiny_model_dir):
    fake = GatedUploads(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1, worker="thread")
    publisher.client = fake
    seen = PublishedAfterStep(publisher)
    fit(tiny_model_dir, fake, [OpenGates(fake), publisher, seen], 5)
    assert publisher.lag_waits == 0
    # the trainer ran two versions ahead of its publication (V - 1's upload opens after V)
    assert max(s - v for s, v in seen.seen) >= 2, seen.seen
    assert publisher.last_published_version == 5  # at fit end


def test_failed_publications_end_the_lag_wait(tiny_model_dir, caplog):
    # the dataflow refuses versions 2 and 3: after step 3 the worker goes idle without
    # version 2 or later published, and the trainer goes on (version 4 is published, full)
    fake = GatedUploads(tiny_model_dir, fail_versions={2, 3})
    for step in range(6):
        fake.gates[step].set()  # no gating: only the failures
    publisher = WeightPublisher(every_n_steps=1, worker="thread", max_lag_versions=1,
                                flush_timeout_s=600)
    publisher.client = fake
    with caplog.at_level("WARNING"):
        fit(tiny_model_dir, fake, [publisher], 4)
    assert publisher.lag_wait_s < 600  # ended by the idle worker, not the timeout
    assert publisher.errors == 2 and publisher.last_published_version == 4
    assert [(m.version, m.kind) for m in fake.manifests] == [(1, "full"), (4, "full")]
    assert "version 2 of 'policy' was not published" in caplog.text
    assert "max_lag_versions=1" in caplog.text


def test_max_lag_versions_must_be_positive():
    with pytest.raises(ValueError, match="max_lag_versions: must be >= 1"):
        WeightPublisher(max_lag_versions=0)
