"""LoRA (astralight.trainer.lora and the RaaS adapter path without vLLM): the config keys, peft wrapping
with target modules / rank / alpha, only adapter parameters training, adapter names in the PEFT
on-disk format, merged weights = base + B @ A * alpha / r, bit-exact adapter deltas, the PEFT
folder the vLLM engine writes, and how the weight sync hands adapter versions to an engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from astralight.trainer.lora import (
    DEFAULT_TARGET_MODULES,
    LoraSpec,
    adapter_config,
    adapter_state_dict,
    base_name,
    merged_state_dict,
    wrap_model,
)
from astralight.trainer.tinymodel import TinyModelSpec, build_model
from astralight.weights import ArtifactBuilder, WeightState, to_bf16_bits
from astralight.weights.delta import apply_delta, encode_delta

L0 = "model.layers.0."


def _wrapped(spec: LoraSpec, seed: int = 0, b_scale: float = 0.5):
    """The tiny model wrapped per ``spec`` (A seeded), with seeded non-zero B (peft starts B
    at 0)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = wrap_model(build_model(TinyModelSpec()), spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_scale)
    return model


# ---------------------------------------------------------------------- config


def test_spec_defaults_and_errors_name_the_key():
    spec = LoraSpec.from_config({})
    assert (spec.r, spec.alpha, spec.dropout, spec.publish) == (8, 16.0, 0.0, "adapter")
    assert spec.target_modules == list(DEFAULT_TARGET_MODULES)
    assert LoraSpec.from_config(None) is None
    assert LoraSpec.from_config({"r": 4, "alpha": 8}).scaling == 2.0
    assert LoraSpec.from_config({"r": 4, "alpha": 8, "use_rslora": True}).scaling == 4.0
    for bad, key in (({"rank": 4}, "unknown keys ['rank']"), ({"r": 0}, "lora.r"),
                     ({"alpha": -1}, "lora.alpha"), ({"dropout": 1.5}, "lora.dropout"),
                     ({"target_modules": []}, "lora.target_modules"),
                     ({"target_modules": "q_proj"}, "lora.target_modules"),
                     ({"publish": "both"}, "lora.publish")):
        with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
            LoraSpec.from_config(bad)


def test_unknown_target_modules_are_refused_by_name():
    with pytest.raises(ValueError, match="lora.target_modules"):
        wrap_model(build_model(TinyModelSpec()), LoraSpec(target_modules=["nope_proj"]))


# ---------------------------------------------------------------------- wrapping


def test_wrapping_follows_target_modules_rank_and_alpha():
    spec = LoraSpec(r=4, alpha=12, target_modules=["q_proj", "down_proj"])
    model = _wrapped(spec)
    cfg = TinyModelSpec()
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    down = model.base_model.model.model.layers[1].mlp.down_proj
    assert tuple(q.lora_A["default"].weight.shape) == (4, cfg.hidden_size)
    assert tuple(q.lora_B["default"].weight.shape) == (cfg.num_attention_heads * cfg.head_dim, 4)
    assert tuple(down.lora_A["default"].weight.shape) == (4, cfg.intermediate_size)
    assert q.scaling["default"] == pytest.approx(3.0)  # alpha / r
    # untargeted layers are plain Linear modules
    k = model.base_model.model.model.layers[0].self_attn.k_proj
    assert type(k).__name__ == "Linear" and not hasattr(k, "lora_A")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2 * 2  # 2 layers x 2 modules x (A, B)


def test_a_fresh_adapter_is_a_no_op_and_only_adapter_params_train():
    base = build_model(TinyModelSpec())
    ids = torch.tensor([[2, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = base(ids).logits
    model = wrap_model(build_model(TinyModelSpec()), LoraSpec(r=4, alpha=8))
    with torch.no_grad():  # B starts at 0: version 0 is still exactly the base model
        assert torch.equal(model(ids).logits, want)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):  # B moves at step 1, A gets gradients from step 2
        opt.zero_grad()
        torch.log_softmax(model(ids).logits, -1)[..., 3].sum().backward()
        opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_A." in n for n in changed) and any(".lora_B." in n for n in changed)


# ---------------------------------------------------------------------- naming


def test_adapter_names_and_config_match_peft_save_pretrained(tmp_path):
    model = _wrapped(LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    state = adapter_state_dict(model)
    assert list(state) and set(state) == set(saved)
    assert all(torch.equal(state[n], saved[n]) for n in saved)
    assert all(n.startswith("base_model.model.model.layers.") for n in state)
    on_disk = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg = adapter_config(model)
    for key in ("r", "lora_alpha", "peft_type", "bias", "use_rslora", "lora_dropout"):
        assert cfg[key] == on_disk[key], key
    assert sorted(cfg["target_modules"]) == sorted(on_disk["target_modules"]) == ["q_proj", "v_proj"]
    json.dumps(cfg)  # plain JSON data: fits a manifest's metadata
    assert base_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == \
        L0 + "mlp.up_proj.weight"


# ---------------------------------------------------------------------- merge


@pytest.mark.parametrize("use_rslora", [False, True])
def test_merged_weights_are_base_plus_scaled_b_times_a(use_rslora):
    spec = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "gate_proj"], use_rslora=use_rslora)
    base = build_model(TinyModelSpec()).state_dict()
    model = _wrapped(spec)
    merged = merged_state_dict(model)
    assert set(merged) == set(base)
    assert list(merged)[:3] == list(base)[:3]  # the checkpoint's order
    scaling = 8 / 4 ** 0.5 if use_rslora else 8 / 4
    inner = model.base_model.model.model
    for i, layer in enumerate(inner.layers):
        for mod, name in ((layer.self_attn.q_proj, "self_attn.q_proj"),
                          (layer.mlp.gate_proj, "mlp.gate_proj")):
            a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            want = base[f"model.layers.{i}.{name}.weight"] + (b @ a) * scaling
            assert torch.allclose(merged[f"model.layers.{i}.{name}.weight"], want, atol=1e-6)
            assert not torch.allclose(want, base[f"model.layers.{i}.{name}.weight"])
    untouched = [n for n in base if "q_proj" not in n and "gate_proj" not in n]
    assert all(torch.equal(merged[n], base[n]) for n in untouched)
    # the trained model is left unmerged (training goes on on the adapters)
    assert hasattr(inner.layers[0].self_attn.q_proj, "lora_A")
    # and equals peft's own merge
    peft_merged = _wrapped(spec).merge_and_unload().state_dict()
    assert max(float((merged[n] - peft_merged[n]).abs().max()) for n in base) < 1e-6


def test_merged_weights_reproduce_the_adapted_model():
    model = _wrapped(LoraSpec(r=4, alpha=8))
    plain = build_model(TinyModelSpec())
    plain.load_state_dict(merged_state_dict(model))
    ids = torch.tensor([[2, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, plain(ids).logits, atol=1e-4)


# ---------------------------------------------------------------------- deltas


def test_an_adapter_delta_round_trips_bit_exactly():
    spec = LoraSpec(r=4, alpha=8)
    v1 = {n: to_bf16_bits(t.to(torch.bfloat16)) for n, t in adapter_state_dict(_wrapped(spec, 1)).items()}
    v2 = {n: a.copy() for n, a in v1.items()}
    rng = np.random.default_rng(0)
    for name in list(v2)[::3]:  # an RL-like step: a few elements of some tensors change
        flat = v2[name].reshape(-1)
        idx = rng.choice(flat.size, size=max(1, flat.size // 20), replace=False)
        flat[idx] ^= rng.integers(1, 1 << 10, idx.size).astype(np.uint16)
    blob, stats = encode_delta(v1, v2, base_version=1, version=2)
    assert 0 < stats.changed_elements < stats.elements
    got = apply_delta({n: a.copy() for n, a in v1.items()}, blob, base_version=1)
    assert set(got) == set(v2)
    assert all(np.array_equal(got[n], v2[n]) for n in v2)


def test_adapter_versions_travel_as_full_then_delta_with_their_config():
    spec = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    model = _wrapped(spec, 1)
    meta = {"adapter": {"type": "lora", "adapter_name": "default",
                        "peft_config": adapter_config(model)}}
    builder, ws = ArtifactBuilder("policy", full_every=10), WeightState()
    states = []
    for version in (1, 2):
        with torch.no_grad():
            model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.add_(0.01)
        snap = {n: t.to(torch.bfloat16) for n, t in adapter_state_dict(model).items()}
        states.append(snap)
        art = builder.build(version, snap)
        art.manifest.metadata = {**art.manifest.metadata, **meta}
        ws.apply(art.manifest, art.files)
        assert art.manifest.kind == ("full" if version == 1 else "delta")
        assert ws.manifest.metadata["adapter"]["peft_config"]["r"] == 4
        held = ws.tensors()
        assert set(held) == set(snap)
        assert all(torch.equal(held[n].view(torch.int16), snap[n].view(torch.int16)) for n in snap)
    assert art.manifest.metadata["changed_tensors"] == 1  # only layer 0's q_proj B moved


# ---------------------------------------------------------------------- the RaaS side, no vLLM


def test_the_engine_writes_a_peft_folder_that_peft_loads(tmp_path):
    from peft import PeftModel

    from astralight.raas.vllm_engine import adapter_peft_config, write_peft_folder

    model = _wrapped(LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    meta = {"type": "lora", "adapter_name": "default", "peft_config": adapter_config(model)}
    tensors = {n: t.to(torch.bfloat16) for n, t in adapter_state_dict(model).items()}
    folder = write_peft_folder(tmp_path / "adapter-v1-1", tensors, adapter_peft_config(meta))
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                       "adapter_model.safetensors"]
    assert not list(tmp_path.glob(".*"))  # the temporary folder was renamed into place
    loaded = PeftModel.from_pretrained(build_model(TinyModelSpec()), str(folder)).eval()
    ids = torch.tensor([[2, 5, 6, 7, 8, 9]])
    reference = build_model(TinyModelSpec())
    reference.load_state_dict(merged_state_dict(_bf16_adapters(model)))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, reference(ids).logits, atol=1e-4)
    # rewriting the same folder (a retried version) replaces it
    write_peft_folder(folder, tensors, adapter_peft_config(meta))
    assert load_file(str(folder / "adapter_model.safetensors")).keys() == tensors.keys()


def _bf16_adapters(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(p.to(torch.bfloat16).float())
    return model


def test_adapter_config_checks_name_the_field():
    from astralight.raas.vllm_engine import adapter_peft_config

    good = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
    assert adapter_peft_config({"type": "lora", "peft_config": good})["inference_mode"] is True
    assert adapter_peft_config(good)["r"] == 4
    with pytest.raises(ValueError, match="adapter.type"):
        adapter_peft_config({"type": "ia3", "peft_config": good})
    with pytest.raises(ValueError, match="peft_type"):
        adapter_peft_config({**good, "peft_type": "IA3"})
    with pytest.raises(ValueError, match="adapter.peft_config"):
        adapter_peft_config({"type": "lora", "peft_config": {"lora_alpha": 8}})


# ---------------------------------------------------------------------- the policy (RLPolicy)


def _fake(model_dir):
    from tests.fakes import FakeDataflowClient

    return FakeDataflowClient(model_dir, logprob_noise=0.2)


def _fit(model_dir, policy, callbacks=(), max_steps=2, fake=None):
    import lightning.pytorch as pl

    from astralight.datamodules import RolloutDataModule

    fake = fake or _fake(model_dir)
    dm = RolloutDataModule("http://127.0.0.1:9", model_id="policy", batch_size=4)
    dm.client = fake
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=list(callbacks))
    fake.trainer = trainer
    trainer.fit(policy, datamodule=dm)
    return fake, trainer


LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_policy_with_lora_trains_only_the_adapters(tiny_model_dir):
    from astralight.policy import M2POPolicy

    policy = M2POPolicy(str(tiny_model_dir), lr=1e-2, lora=LORA)
    assert policy.hparams["lora"] == LORA and policy.lora_publish == "adapter"
    policy.configure_model()
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    _, trainer = _fit(tiny_model_dir, policy)
    assert trainer.global_step == 2
    opt = trainer.optimizers[0]
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    adapters = {id(p) for n, p in policy.model.named_parameters() if ".lora_" in n}
    assert in_opt == adapters  # the optimizer holds the adapters and nothing else
    after = policy.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)
    assert {k for k in before if ".lora_B." in k} <= changed


def test_lora_kl_reference_is_the_base_model_with_adapters_disabled(tiny_model_dir):
    from astralight.datamodules import collate_batch
    from astralight.policy import M2POPolicy, load_causal_lm
    from astralight.rl.logprobs import causal_lm_logprobs, first_trained_target
    from tests.fakes import FakeDataflowClient

    policy = M2POPolicy(str(tiny_model_dir), kl_coef=0.1, lora=LORA)
    policy.configure_model()
    assert policy.ref_model is None  # no second model loaded
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if ".lora_B." in n:
                p.normal_()
    batch = policy.prepare_batch(collate_batch(FakeDataflowClient(tiny_model_dir).make_batch(4)))
    ref = policy._reference_logprobs(batch)
    base = load_causal_lm(str(tiny_model_dir)).eval()
    with torch.no_grad():
        want = causal_lm_logprobs(base, batch["input_ids"], batch["attention_mask"])
        now = policy(batch["input_ids"], batch["attention_mask"])
    # from the first trained column on (the output projection skips the prompt before it:
    # those columns are 0 and never read, astralight.rl.logprobs.causal_lm_next_logits)
    first = first_trained_target(batch["mask"])
    assert first > 0 and torch.equal(ref[:, :first], torch.zeros_like(ref[:, :first]))
    torch.testing.assert_close(ref[:, first:], want[:, first:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(now[:, first:], want[:, first:], atol=1e-3)  # adapters back on
    out = policy.accumulate_gradients(batch)
    assert float(out["kl_k3"]) > 0


def test_lora_dropout_needs_dropout_enabled(tiny_model_dir):
    from astralight.policy import M2POPolicy

    with pytest.raises(ValueError, match="lora.dropout"):
        M2POPolicy(str(tiny_model_dir), lora={"dropout": 0.1})
    M2POPolicy(str(tiny_model_dir), lora={"dropout": 0.1}, disable_dropout=False)
    with pytest.raises(ValueError, match="lora.publish"):
        M2POPolicy(str(tiny_model_dir), lora={"publish": "full"})


# ---------------------------------------------------------------------- the publisher


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_publisher_sends_adapters_or_merged_weights(tiny_model_dir, mode):
    import lightning.pytorch as pl

    from astralight.callbacks import WeightPublisher
    from astralight.policy import M2POPolicy

    class Record(pl.Callback):  # the expected state at every published step
        def __init__(self):
            self.at_step = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            assert publisher.flush(timeout=60)
            model = pl_module.model
            state = adapter_state_dict(model) if mode == "adapter" else merged_state_dict(model)
            self.at_step[trainer.global_step] = {n: to_bf16_bits(t.detach().to(torch.bfloat16))
                                                 for n, t in state.items()}

    policy = M2POPolicy(str(tiny_model_dir), lr=1e-2, lora={**LORA, "publish": mode})
    publisher = WeightPublisher(full_every=10, worker="thread")
    publisher.client = fake = _fake(tiny_model_dir)  # the fake's weight-store face
    record = Record()
    _fit(tiny_model_dir, policy, [publisher, record], fake=fake)
    assert [m.kind for m in fake.manifests] == ["full", "delta"]
    base_names = set(build_model(TinyModelSpec()).state_dict())
    ws = WeightState()
    for m in fake.manifests:
        ws.apply(m, {n: d for v, n, d in fake.uploads if v == m.version})
        want = record.at_step[m.version]
        assert set(ws.state) == set(want)
        assert all(np.array_equal(ws.state[n], want[n]) for n in want), m.version
        if mode == "adapter":
            assert m.metadata["adapter"]["peft_config"]["r"] == 4
            assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in m.tensors)
        else:
            assert "adapter" not in m.metadata
            assert set(m.tensors) == base_names


# ---------------------------------------------------------------------- the weight sync


class _Store:
    """The weight half of DataflowClient, in memory."""

    def __init__(self):
        self.manifests, self.files = {}, {}

    def add(self, artifact, metadata=None):
        m = artifact.manifest
        m.metadata = {**m.metadata, **(metadata or {})}
        self.manifests[m.version] = m
        self.files.update({(m.version, n): d for n, d in artifact.files.items()})

    def latest_manifest(self, model_id):
        return self.manifests[max(self.manifests)] if self.manifests else None

    def manifest(self, model_id, version):
        return self.manifests[version]

    def download_weight_file(self, model_id, version, name):
        return self.files[(version, name)]

    def close(self):
        pass


class _Engine:
    def __init__(self, adapters=True):
        self.version = 0
        self.calls = []
        if adapters:
            self.update_adapter = self._update_adapter

    def update_weights(self, named_tensors, version, partial=False):
        self.calls.append(("weights", version, sorted(named_tensors)))
        self.version = version

    def _update_adapter(self, named_tensors, version, adapter):
        self.calls.append(("adapter", version, {n: t.clone() for n, t in named_tensors.items()},
                           adapter))
        self.version = version


def test_weight_sync_hands_adapter_versions_to_the_adapter_path():
    from astralight.raas.weight_sync import WeightSync

    model = _wrapped(LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    meta = {"adapter": {"type": "lora", "adapter_name": "default",
                        "peft_config": adapter_config(model)}}
    store, builder = _Store(), ArtifactBuilder("policy")
    engine = _Engine()
    sync = WeightSync(lambda: store, "policy", engine, background=False,
                      check_interval_s=0.0)
    snaps = []
    for version in (1, 2, 3):
        if version == 2:
            with torch.no_grad():
                model.base_model.model.model.layers[1].self_attn.v_proj.lora_B["default"].weight.mul_(2)
        snap = {n: t.to(torch.bfloat16) for n, t in adapter_state_dict(model).items()}
        snaps.append(snap)
        store.add(builder.build(version, snap), meta)  # v3: bit-identical to v2
        sync.refresh()
        assert engine.version == version
    assert [c[:2] for c in engine.calls] == [("adapter", 1), ("adapter", 2)]  # v3: version only
    for (_, _, tensors, adapter), snap in zip(engine.calls, snaps):
        assert set(tensors) == set(snap)  # the whole adapter, even after a one-tensor delta
        assert all(torch.equal(tensors[n].view(torch.int16), snap[n].view(torch.int16)) for n in snap)
        assert adapter["peft_config"]["r"] == 4
    assert store.manifests[2].kind == "delta" and sync.delta_pulls == 2
    # merged (full, base names) afterwards goes through update_weights
    store.add(builder.build(4, {n: t.to(torch.bfloat16) for n, t in merged_state_dict(model).items()}))
    sync.refresh()
    assert engine.calls[-1][:2] == ("weights", 4) and engine.version == 4
    sync.close()


def test_an_engine_without_adapter_support_keeps_its_version_and_says_why():
    from astralight.raas.weight_sync import EngineConfigError, WeightSync

    model = _wrapped(LoraSpec(r=4, alpha=8, target_modules=["q_proj"]))
    store = _Store()
    store.add(ArtifactBuilder("policy").build(1, adapter_state_dict(model)),
              {"adapter": {"type": "lora", "peft_config": adapter_config(model)}})
    engine = _Engine(adapters=False)
    sync = WeightSync(lambda: store, "policy", engine, background=False, check_interval_s=0.0)
    # a config error, not a passing failure: the RaaS stops on it (exit 2) instead of retrying
    with pytest.raises(EngineConfigError, match="enable_lora"):
        sync.refresh()
    assert engine.version == 0 and engine.calls == []
    sync.close()
