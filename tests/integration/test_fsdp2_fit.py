"""FSDP2 through Lightning's ``ModelParallelStrategy``: real ``Trainer.fit`` of the policy on the
tiny model, on CPU (gloo).

- one rank: M2PO steps (micro-batches, KL to the sharded reference, a binding gradient clip,
  gradient checkpointing) give the same weights as ``strategy="auto"`` (float32, so tight);
  bf16-mixed keeps fp32 masters; LoRA trains only the adapters; the publisher sends the same
  names and bits as unsharded (tied embeddings published once; adapter names);
- two ranks (a subprocess: Lightning's launcher re-runs tests/integration/fsdp2_two_ranks.py for
  rank 1): every parameter really is split in half, and the gathered, published and received
  weights equal a single-process run on both ranks' batches concatenated;
- ``FSDPStrategy`` (FSDP1) is refused with the fix and the Lightning issue; tensor parallelism too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from astralight.callbacks import WeightPublisher
from astralight.datamodules import collate_batch
from astralight.policy import M2POPolicy
from astralight.protocol import Batch
from astralight.weights import WeightState, to_bf16_bits
from tests.integration.fsdp2_helpers import _full_state, _identity
from tests.fakes import FakeDataflowClient

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = dict(lr=1e-3, micro_batch_size=2, kl_coef=0.1, grad_clip=0.05,
                gradient_checkpointing=True, m2_threshold=0.01)


def _mp():
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)


def fit(model_dir, batches, strategy, precision="32-true", callbacks=(), **kwargs):
    policy = M2POPolicy(str(model_dir), **{**SETTINGS, **kwargs})
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision,
                         max_steps=len(batches), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks))
    trainer.fit(policy, train_dataloaders=DataLoader(batches, batch_size=None,
                                                     collate_fn=_identity))
    return policy, trainer


def test_one_rank_fsdp2_equals_auto(tiny_model_dir, batches, clean_dist):
    from torch.distributed.tensor import DTensor

    auto, t_auto = fit(tiny_model_dir, batches, "auto")
    sharded, t_mp = fit(tiny_model_dir, batches, _mp())
    assert sharded._sharded and all(isinstance(p, DTensor) for p in sharded.model.parameters())
    assert all(isinstance(p, DTensor) for p in sharded.ref_model.parameters())  # KL ref sharded
    # the clip binds (norm > 2 x 0.05), so a wrong global norm would change the weights
    norm_auto, norm_mp = (float(t.callback_metrics["train/grad_norm"]) for t in (t_auto, t_mp))
    assert norm_auto > 2 * SETTINGS["grad_clip"] and norm_mp == pytest.approx(norm_auto, rel=1e-5)
    assert float(t_mp.callback_metrics["train/kl_k3"]) == pytest.approx(
        float(t_auto.callback_metrics["train/kl_k3"]), rel=1e-4)
    want, got = _full_state(auto), _full_state(sharded)
    initial = M2POPolicy(str(tiny_model_dir))
    initial.configure_model()
    assert set(got) == set(want)
    for name, w in want.items():
        assert not torch.equal(w, initial.model.state_dict()[name]), name  # it trained
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_mixed_keeps_fp32_masters_and_bf16_compute(tiny_model_dir, batches, clean_dist):
    from torch.distributed.fsdp import FSDPModule

    policy, trainer = fit(tiny_model_dir, batches[:1], _mp(), precision="bf16-mixed")
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    root = policy.model
    assert isinstance(root, FSDPModule)
    mp = root._get_fsdp_state()._mp_policy
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_lora_under_fsdp2_trains_only_adapters(tiny_model_dir, batches, clean_dist):
    lora = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    initial = M2POPolicy(str(tiny_model_dir), lora=lora)
    initial.configure_model()
    before = _full_state(initial)
    auto, _ = fit(tiny_model_dir, batches, "auto", lora=lora)
    sharded, _ = fit(tiny_model_dir, batches, _mp(), lora=lora)
    trainable = [n for n, p in sharded.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    after, want = _full_state(sharded), _full_state(auto)
    assert set(after) == set(before) == set(want)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_B." in n or ".lora_A." in n for n in changed)
    assert any(".lora_B." in n for n in changed)
    for name, w in want.items():
        torch.testing.assert_close(after[name], w, rtol=1e-5, atol=1e-6, msg=name)


class _Flush(pl.Callback):
    def __init__(self, publisher):
        self.publisher = publisher

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert self.publisher.flush(timeout=60)


def _published(model_dir, batches, strategy, **kwargs):
    fake = FakeDataflowClient(model_dir)
    publisher = WeightPublisher(worker="thread", full_every=10)
    publisher.client = fake
    fit(model_dir, batches, strategy, callbacks=[publisher, _Flush(publisher)], **kwargs)
    ws, states = WeightState(), []
    for m in fake.manifests:
        ws.apply(m, {n: d for v, n, d in fake.uploads if v == m.version})
        states.append({n: a.copy() for n, a in ws.state.items()})
    return fake.manifests, states


@pytest.mark.parametrize("variant", ["tied", "lora_adapter", "lora_merged"])
def test_publisher_under_fsdp2_sends_what_unsharded_sends(tmp_path, variant, clean_dist):
    from astralight.trainer.tinymodel import (
        TinyModelSpec,
        build_model,
        build_tokenizer,
        save_model_folder,
    )

    model_dir = save_model_folder(build_model(TinyModelSpec(tie_word_embeddings=True)),
                                  build_tokenizer(), tmp_path / "tied")
    fake = FakeDataflowClient(model_dir, logprob_noise=0.3, seed=2)
    data = [collate_batch(fake.make_batch(4)) for _ in range(2)]
    kwargs = {}
    if variant != "tied":
        kwargs["lora"] = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"],
                          "publish": variant.split("_")[1]}
    want_m, want_s = _published(model_dir, data, "auto", **kwargs)
    got_m, got_s = _published(model_dir, data, _mp(), **kwargs)
    assert [(m.version, m.kind) for m in got_m] == [(m.version, m.kind)
                                                    for m in want_m] == [(1, "full"), (2, "delta")]
    for g, w in zip(got_m, want_m):
        assert sorted(g.tensors) == sorted(w.tensors)
        assert (g.metadata or {}).get("adapter") == (w.metadata or {}).get("adapter")
    names = sorted(got_m[0].tensors)
    if variant == "tied":
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    elif variant == "lora_adapter":
        assert names and all(n.startswith("base_model.model.") and ".lora_" in n for n in names)
    else:
        assert "model.layers.0.self_attn.q_proj.weight" in names and not any(
            ".lora_" in n for n in names)
    for g, w in zip(got_s, want_s):
        assert set(g) == set(w)
        for name in w:
            a, b = g[name].view(np.uint16), w[name].view(np.uint16)
            # bf16 of float32 weights equal to ~1e-6: at most one bf16 ulp apart, rarely
            diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
            assert diff.max() <= 1 and (diff > 0).mean() < 0.01, name


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """The tiny model with tied input/output embeddings (as Qwen3-0.6B and 1.7B have)."""
    from astralight.trainer.tinymodel import TinyModelSpec, build_model, build_tokenizer, save_model_folder

    return save_model_folder(build_model(TinyModelSpec(tie_word_embeddings=True)),
                             build_tokenizer(), tmp_path_factory.mktemp("tied") / "model")


@pytest.mark.parametrize("variant", ["full", "tied", "lora"])
def test_two_ranks_shard_for_real_and_match_one_process(tiny_model_dir, tied_model_dir, tmp_path,
                                                        variant):
    """Two gloo ranks on CPU: each holds half of every parameter; only rank 0 read the model
    folder (rank 1 got its shards by broadcast); the gathered / published / received / saved
    weights equal one process training on both ranks' batches at once."""
    import json

    from safetensors.torch import load_file

    from tests.integration.fsdp2_two_ranks import LORA, SETTINGS as TWO, STEPS, rank_batches

    lora = variant == "lora"
    if variant == "tied":
        tiny_model_dir = tied_model_dir

    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    args = [sys.executable, str(ROOT / "tests/integration/fsdp2_two_ranks.py"),
            str(tiny_model_dir), str(out)] + (["--lora"] if lora else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["mesh_size"] for r in ranks] == [2, 2]  # FSDP2Strategy() "auto" = every process
    assert [r["weights_source"] for r in ranks] == ["file", "rank0"]
    assert all(r["ref_sharded"] for r in ranks)
    for name, s0 in ranks[0]["shards"].items():
        s1 = ranks[1]["shards"][name]
        assert s0["dtensor"] and s1["dtensor"] and s0["full"] == s1["full"]
        full = s0["full"]
        assert s0["local"][0] == (full[0] + 1) // 2 and s0["local"][0] + s1["local"][0] == full[0]
        assert s0["local"][1:] == full[1:] == s1["local"][1:]
    result = torch.load(out / "rank0.pt")

    # the reference: one process, step i on batches 2i and 2i+1 together
    raw = rank_batches(str(tiny_model_dir))
    merged = [collate_batch(Batch(batch_id=f"m{i}", model_id="policy", policy_version=0,
                                  samples=raw[2 * i].samples + raw[2 * i + 1].samples))
              for i in range(STEPS)]
    ref = M2POPolicy(str(tiny_model_dir), lora=LORA if lora else None, **TWO)
    ref_trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[norms := _Norms()])
    ref_trainer.fit(ref, train_dataloaders=DataLoader(merged, batch_size=None,
                                                      collate_fn=_identity))
    assert result["grad_norms"] == pytest.approx(norms.values, rel=1e-4)
    assert min(norms.values) > TWO["grad_clip"]  # the clip bound on every step

    publisher = WeightPublisher(worker="thread")
    want = publisher.publish_state(types.SimpleNamespace(strategy=types.SimpleNamespace(),
                                                         is_global_zero=True), ref)
    got = result["state"]
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w.detach(), rtol=1e-4, atol=1e-5, msg=name)
    # what the fake dataflow received (full, then a delta) is the bf16 of the gathered state
    assert [(v, k) for v, k, _ in result["manifests"]] == [(1, "full"), (2, "delta")]
    assert all(names == sorted(want) for _, _, names in result["manifests"])
    for name, t in got.items():
        assert np.array_equal(result["received"][name].numpy(), to_bf16_bits(t.to(torch.bfloat16)))

    # save_pretrained under FSDP2: rank 0 wrote the gathered weights as a Hugging Face folder
    saved_dir = out / "hf"
    if lora:
        saved = load_file(str(saved_dir / "adapter_model.safetensors"))
        ref_dir = tmp_path / "ref_adapter"
        ref.save_pretrained(str(ref_dir))
        want_saved = load_file(str(ref_dir / "adapter_model.safetensors"))
        assert (saved_dir / "adapter_config.json").is_file()
    else:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(saved_dir), dtype=torch.float32)
        saved = loaded.state_dict()
        want_saved = ref.model.state_dict()
        tied = loaded.config.tie_word_embeddings
        assert tied == (variant == "tied")
        assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) \
            == tied
        assert (saved_dir / "tokenizer.json").is_file()
    assert set(saved) == set(want_saved)
    for name, w in want_saved.items():
        torch.testing.assert_close(saved[name], w.detach(), rtol=1e-4, atol=1e-5, msg=name)


class _Norms(pl.Callback):
    def __init__(self):
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["train/grad_norm"]))


def test_fsdp1_strategy_is_refused_with_the_fix(tiny_model_dir):
    from lightning.pytorch.strategies import FSDPStrategy

    policy = M2POPolicy(str(tiny_model_dir))
    policy._trainer = types.SimpleNamespace(strategy=FSDPStrategy(), precision="bf16-mixed")
    with pytest.raises(ValueError) as info:
        policy.configure_model()
    msg = str(info.value)
    assert "FSDPStrategy (FSDP1)" in msg and "ModelParallelStrategy" in msg
    assert "#19685" in msg and "tensor_parallel_size: 1" in msg
    assert policy.model is None  # refused before loading anything


def test_tensor_parallel_is_refused():
    from astralight.trainer.fsdp2 import data_parallel_mesh

    class Mesh:  # what ModelParallelStrategy(tensor_parallel_size=2) gives the module
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __getitem__(self, key):
            return types.SimpleNamespace(size=lambda: 2)

    with pytest.raises(ValueError, match="tensor_parallel_size: 2 is not supported"):
        data_parallel_mesh(types.SimpleNamespace(_device_mesh=Mesh()))
    assert data_parallel_mesh(types.SimpleNamespace(_device_mesh=None)) is None


class _AtTrainStart(pl.Callback):
    """Records, when training (re)starts, the step, AdamW's step count and the full weights;
    at the end, the full weights."""

    def _weights(self, module):
        return _full_state(module)

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step
        self.adam_steps = {int(s["step"]) for s in trainer.optimizers[0].state.values()}
        self.start = self._weights(pl_module)

    def on_train_end(self, trainer, pl_module):
        self.end = self._weights(pl_module)


def test_checkpoint_folder_saves_and_resumes_under_fsdp2(tiny_model_dir, tmp_path, clean_dist):
    """ModelParallelStrategy writes last.ckpt as a distributed-checkpoint folder; ``ckpt_path=
    "last"`` restores the sharded weights, AdamW's state, the loops, the publisher's counters
    (its first version after the resume is full) and the datamodule's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from astralight.trainer.checkpoint_io import install
    from astralight.datamodules import RolloutDataModule

    fake = FakeDataflowClient(tiny_model_dir)

    def run(steps, ckpt_path=None):
        dm = RolloutDataModule("http://127.0.0.1:9", model_id="policy", batch_size=4)
        dm.client = fake
        publisher = WeightPublisher(worker="thread", full_every=10)
        publisher.client = fake
        probe = _AtTrainStart()
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=_mp(), max_steps=steps, logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
            callbacks=[publisher, _Flush(publisher), probe, ModelCheckpoint(
                dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)])
        install(trainer)  # what astralight fit does; this strategy writes its own folder
        fake.trainer = trainer
        trainer.fit(M2POPolicy(str(tiny_model_dir), lr=1e-3, kl_coef=0.1, micro_batch_size=2),
                    datamodule=dm, ckpt_path=ckpt_path)
        return trainer, probe, publisher, dm

    _, first, _, _ = run(2)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_dir() and (last / "meta.pt").is_file()  # a DCP folder, not one file
    trainer, resumed, publisher, dm = run(4, ckpt_path="last")
    assert resumed.step == 2 and resumed.adam_steps == {2}
    assert set(resumed.start) == set(first.end)
    for name, w in first.end.items():
        assert torch.equal(resumed.start[name], w), name
    assert trainer.global_step == 4
    assert [(m.version, m.kind) for m in fake.manifests] == [
        (1, "full"), (2, "delta"), (3, "full"), (4, "delta")]
    assert publisher.state_dict()["last_published_version"] == 4
    assert dm.state_dict()["batches_acknowledged"] == 4
