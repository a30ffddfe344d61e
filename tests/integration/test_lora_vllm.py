"""LoRA publish -> RaaS load -> generations change, with a real vLLM engine on CPU.

The trainer side publishes to the real dataflow service over HTTP exactly as the WeightPublisher
does (adapter tensors under PEFT names, ``metadata["adapter"]`` with the peft config; full first,
bf16 deltas after); a :class:`WeightSync` pulls and verifies the versions and hands adapter
versions to ``VLLMEngine.update_adapter``, which writes a PEFT folder and switches generation to
a new LoRA id -- the same ``vllm.LLM`` throughout (no restart). Checked:

* adapter v1 (non-zero B): greedy generations differ from the base model's, and vLLM's log-probs
  match transformers on base + adapter; v2 arrives as a delta and replaces v1 (v1's folder and
  id are gone, log-probs now match v2, not v1);
* a merged publication (full weights under the base names) reaches the same engine through the
  ordinary full-weight path: the adapter is dropped, vLLM holds the merged bf16 weights bit for
  bit, generations differ from the base model's;
* an adapter vLLM refuses (DoRA) or whose rank exceeds ``max_lora_rank`` raises and leaves the
  engine on its current version and adapter;
* the real trainer: ``M2POPolicy(lora=...)`` trained by Lightning with the real WeightPublisher,
  once with ``publish: adapter`` and once with ``publish: merged``, lands in the engine.

One module-scoped engine pays vLLM's start-up once; each test gets its own dataflow service.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from astralight.dataflow.client import DataflowClient
from astralight.engine import SamplingSpec
from astralight.trainer.lora import LoraSpec, adapter_config, adapter_state_dict, merged_state_dict, wrap_model
from astralight.raas.weight_sync import WeightSync
from astralight.weights import ArtifactBuilder

pytestmark = pytest.mark.vllm

RANK = 8
LOGPROB_ATOL = 0.03  # bf16 engine (LoRA kernels in bf16) vs float32 reference on bf16 weights
PROMPTS = ["37+45=", "1+2=", "99+99=", "12+7=", "50+50=", "3+4=", "8+80=", "21+12="]
SPEC = LoraSpec(r=RANK, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    from astralight.raas.vllm_engine import VLLMEngine

    eng = VLLMEngine(str(tiny_model_dir), dtype="bfloat16", max_model_len=128, seed=0,
                     kv_cache_memory_bytes=64 << 20, enforce_eager=True, warmup=True,
                     enable_lora=True, max_lora_rank=RANK)
    yield eng
    eng.close()


@pytest.fixture
def engine(vllm_engine, tiny_model_dir):
    """The shared engine on the initial model (version 0), no adapter."""
    from safetensors.torch import load_file

    vllm_engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors")), version=0)
    assert vllm_engine.adapter is None
    return vllm_engine


def _prompt_ids(engine):
    return [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def greedy(engine) -> list[list[int]]:
    return [c.token_ids for c in engine.generate_batch(_prompt_ids(engine), SamplingSpec(temperature=0,
                                                                                   max_tokens=8))]


def _wrapped(model_dir, seed: int, b_scale: float = 0.3):
    """The tiny model from its folder with a LoRA of SPEC; A and B seeded, B non-zero."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = wrap_model(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                           SPEC)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape) * b_scale)
    return model


class AdapterPublisher:
    """What the WeightPublisher sends for a LoRA policy, straight to the dataflow."""

    def __init__(self, url: str):
        self.client = DataflowClient(url, retry_s=10)
        self.builder = ArtifactBuilder("policy", full_every=10)

    def publish(self, version: int, state: dict, metadata: dict | None = None):
        art = self.builder.build(version, {n: t.to(torch.bfloat16) for n, t in state.items()})
        art.manifest.metadata = {**art.manifest.metadata, **(metadata or {})}
        for name, data in art.files.items():
            self.client.upload_weight_file("policy", version, name, data)
        self.client.publish(art.manifest)
        return art.manifest

    def publish_adapter(self, version: int, model):
        meta = {"adapter": {"type": "lora", "adapter_name": "default",
                            "peft_config": adapter_config(model)}}
        return self.publish(version, adapter_state_dict(model), meta)


def _bf16_reference(model_dir, model=None) -> torch.nn.Module:
    """transformers (float32) on what the engine should compute: the bf16 base weights, plus
    the bf16 adapters of ``model`` (merged in float32) if given."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    source = ref if model is None else model
    state = {k: v.detach().to(torch.bfloat16).float() for k, v in source.state_dict().items()}
    ref.load_state_dict(state if model is None else merged_state_dict(model, state))
    return ref


def logprob_gap(engine, reference) -> float:
    """max |vLLM log-prob - transformers log-prob| over sampled completions."""
    ids = _prompt_ids(engine)
    comps = engine.generate_batch(ids, SamplingSpec(temperature=1.0, max_tokens=8, seed=5))
    gaps = []
    with torch.no_grad():
        for prompt, c in zip(ids, comps):
            seq = prompt + c.token_ids
            logits = reference(torch.tensor([seq])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            gaps.append(np.abs(np.array(c.logprobs) - lp[len(prompt) - 1:].numpy()))
    return float(np.concatenate(gaps).max())


def assert_engine_holds(engine, state: dict) -> None:
    """Every base tensor vLLM computes with equals the bf16 cast of ``state``, bit for bit."""
    held = engine.held_weights({n: list(t.shape) for n, t in state.items()})
    assert set(held) == set(state)
    bad = [n for n, t in state.items()
           if not torch.equal(held[n].view(torch.int16), t.to(torch.bfloat16).view(torch.int16))]
    assert not bad, f"vLLM holds other weights than published for {bad}"


def _sync(url, engine):
    return WeightSync(lambda: DataflowClient(url, retry_s=10), "policy", engine,
                      check_interval_s=0.0, background=False)


def test_adapter_versions_load_without_restart_and_change_generations(engine, tiny_model_dir,
                                                                      tmp_path, dataflow_service):
    svc = dataflow_service(tmp_path)
    pub = AdapterPublisher(svc.url)
    sync = _sync(svc.url, engine)
    llm, loads = engine.llm, engine.adapter_loads
    try:
        g0 = greedy(engine)
        m1 = _wrapped(tiny_model_dir, seed=1)
        assert pub.publish_adapter(1, m1).kind == "full"
        sync.refresh()
        assert engine.version == 1 and engine.adapter is not None and engine.llm is llm
        folder1 = Path(engine.adapter)
        assert sorted(p.name for p in folder1.iterdir()) == ["adapter_config.json",
                                                            "adapter_model.safetensors"]
        g1 = greedy(engine)
        differ = sum(a != b for a, b in zip(g0, g1))
        print(f"\nadapter v1: {differ}/{len(g0)} greedy completions differ from the base model's")
        assert differ >= len(g0) // 2
        gap_v1 = logprob_gap(engine, _bf16_reference(tiny_model_dir, m1))
        gap_base = logprob_gap(engine, _bf16_reference(tiny_model_dir, None))
        print(f"adapter v1: logprob |vLLM - HF(base+adapter)| max {gap_v1:.4f}, vs HF(base) {gap_base:.4f}")
        assert gap_v1 < LOGPROB_ATOL < 3 * LOGPROB_ATOL < gap_base

        # version 2: other B in half of the layers -> a delta; it replaces v1 in the engine
        m2 = _wrapped(tiny_model_dir, seed=1)
        with torch.no_grad():
            for name, p in m2.named_parameters():
                if "lora_B" in name and ".layers.1." in name:
                    p.mul_(-1.5)
        assert pub.publish_adapter(2, m2).kind == "delta"
        sync.refresh()
        assert engine.version == 2 and engine.llm is llm and sync.delta_pulls == 1
        assert engine.adapter_loads == loads + 2
        assert not folder1.exists()  # v1's folder (and vLLM id) removed
        assert engine.llm.llm_engine.list_loras() == {engine._lora.lora_int_id}
        gap_v2 = logprob_gap(engine, _bf16_reference(tiny_model_dir, m2))
        gap_v1_now = logprob_gap(engine, _bf16_reference(tiny_model_dir, m1))
        print(f"adapter v2: logprob gap to HF(v2) {gap_v2:.4f}, to HF(v1) {gap_v1_now:.4f}")
        assert gap_v2 < LOGPROB_ATOL < 3 * LOGPROB_ATOL < gap_v1_now
        assert greedy(engine) != g1
    finally:
        sync.close()
        pub.client.close()


def test_a_merged_publication_changes_generations(engine, tiny_model_dir, tmp_path,
                                                  dataflow_service):
    svc = dataflow_service(tmp_path)
    pub = AdapterPublisher(svc.url)
    sync = _sync(svc.url, engine)
    try:
        g0 = greedy(engine)
        model = _wrapped(tiny_model_dir, seed=3)
        pub.publish_adapter(1, model)  # first an adapter version ...
        sync.refresh()
        assert engine.adapter is not None
        merged = merged_state_dict(model)
        assert pub.publish(2, merged).kind == "full"  # ... then merged weights: base names
        sync.refresh()
        assert engine.version == 2 and engine.adapter is None  # the full version replaced it
        assert_engine_holds(engine, merged)
        g2 = greedy(engine)
        differ = sum(a != b for a, b in zip(g0, g2))
        print(f"\nmerged: {differ}/{len(g0)} greedy completions differ from the base model's")
        assert differ >= len(g0) // 2
    finally:
        sync.close()
        pub.client.close()


def test_a_refused_adapter_leaves_the_engine_on_its_version(engine, tiny_model_dir):
    model = _wrapped(tiny_model_dir, seed=4)
    tensors = {n: t.to(torch.bfloat16) for n, t in adapter_state_dict(model).items()}
    meta = {"type": "lora", "peft_config": adapter_config(model)}
    engine.update_adapter(tensors, 1, meta)
    current, g1 = engine.adapter, greedy(engine)
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine.update_adapter(tensors, 2, {"type": "lora",
                                           "peft_config": {**meta["peft_config"], "r": 2 * RANK}})
    with pytest.raises(Exception, match="DoRA"):  # vLLM's own check, at load time
        engine.update_adapter(tensors, 2, {"type": "lora",
                                           "peft_config": {**meta["peft_config"], "use_dora": True}})
    with pytest.raises(ValueError, match="PEFT LoRA tensor names"):
        engine.update_adapter({"model.layers.0.self_attn.q_proj.weight": torch.zeros(1)}, 2, meta)
    assert engine.version == 1 and engine.adapter == current and greedy(engine) == g1
    assert Path(current).exists()
    assert len(list(Path(current).parent.iterdir())) == 1  # no folder of a refused adapter left


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_a_lora_policy_trained_by_lightning_reaches_the_engine(mode, engine, tiny_model_dir,
                                                               tmp_path, dataflow_service):
    """M2POPolicy(lora=...) under Trainer.fit, the real WeightPublisher (encoder process) into
    the real dataflow, then the RaaS weight sync into vLLM."""
    import lightning.pytorch as pl
    from safetensors.torch import load_file

    from astralight.callbacks import WeightPublisher
    from astralight.datamodules import RolloutDataModule
    from astralight.policy import M2POPolicy
    from tests.fakes import FakeDataflowClient

    svc = dataflow_service(tmp_path)
    policy = M2POPolicy(str(tiny_model_dir), lr=1e-2,
                        lora={"r": RANK, "alpha": 16, "publish": mode})
    policy.configure_model()
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # a policy already far from base
        torch.manual_seed(7)
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape) * 0.3)
    fake = FakeDataflowClient(tiny_model_dir)  # batches only; weights go to the real service
    dm = RolloutDataModule("http://127.0.0.1:9", model_id="policy", batch_size=4)
    dm.client = fake
    publisher = WeightPublisher(dataflow_url=svc.url, full_every=10)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[publisher])
    trainer.fit(policy, datamodule=dm)
    assert publisher.published_versions == [1, 2] and publisher.errors == 0

    sync = _sync(svc.url, engine)
    try:
        g0 = greedy(engine)
        sync.refresh()
        assert engine.version == 2
        if mode == "adapter":
            held = load_file(str(Path(engine.adapter) / "adapter_model.safetensors"))
            want = adapter_state_dict(policy.model)
            assert set(held) == set(want)
            assert all(torch.equal(held[n].view(torch.int16),
                                   want[n].detach().to(torch.bfloat16).view(torch.int16))
                       for n in want)
        else:
            assert engine.adapter is None
            assert_engine_holds(engine, merged_state_dict(policy.model))
        differ = sum(a != b for a, b in zip(g0, greedy(engine)))
        print(f"\n{mode}: {differ}/{len(g0)} greedy completions differ from the base model's")
        assert differ >= len(g0) // 2
    finally:
        sync.close()
