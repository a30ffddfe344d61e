"""Weight sync into a real vLLM engine on CPU, from the real dataflow service over HTTP.

What is checked, against what the engine *holds* (``VLLMEngine.held_weights`` reads every tensor
back from vLLM, linear kernels included) and against transformers log-probs:

* partial push: after a delta touching a few tensors, only those modules (with their fused
  partners) are sent, every tensor vLLM holds equals the reconstructed bf16 state bit for bit, and
  vLLM's log-probs match transformers on those weights;
* a byte flipped on the wire in a delta is detected, counted in ``full_fallbacks``, and the full
  pull that follows at once lands the engine on the right weights;
* a delta corrupt in the store leaves the engine on its previous (intact) version; the next full
  version brings it forward;
* a sync that joins late starts from the last full version and then follows deltas;
* a float32 publication (``WeightPublisher(precision="fp32")``'s split halves) reaches a float32
  engine exactly: an update too small for bf16 changes its log-probs as it changes the trainer's.

One module-scoped engine pays vLLM's start-up and warm-up once (~20 s); each test gets its own
dataflow service process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from astralight.dataflow.client import DataflowClient
from astralight.engine import SamplingSpec
from astralight.netshape import ShapedProxy
from astralight.raas.weight_sync import WeightSync
from astralight.weights import ArtifactBuilder
from astralight.weights.delta import MAGIC

pytestmark = pytest.mark.vllm

LOGPROB_ATOL = 0.03  # bf16 engine vs float32 reference on bf16 weights (see test_vllm_engine.py)
PROMPTS = ["37+45=", "1+2=", "99+99=", "12+7=", "50+50=", "3+4=", "8+80=", "21+12="]
L0 = "model.layers.0."
L1 = "model.layers.1."


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    from astralight.raas.vllm_engine import VLLMEngine

    eng = VLLMEngine(str(tiny_model_dir), dtype="bfloat16", max_model_len=128, seed=0,
                     kv_cache_memory_bytes=64 << 20, enforce_eager=True, warmup=True)
    yield eng
    eng.close()


@pytest.fixture
def engine(vllm_engine, tiny_model_dir):
    """The shared engine, back on the initial model (version 0) for every test."""
    from safetensors.torch import load_file

    vllm_engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors")), version=0)
    return vllm_engine


def _state(seed: int, sharpen: float = 4.0) -> dict[str, torch.Tensor]:
    from astralight.trainer.tinymodel import TinyModelSpec, build_model

    sd = {k: v.detach().clone() for k, v in build_model(TinyModelSpec(seed=seed)).state_dict().items()}
    sd["lm_head.weight"] *= sharpen  # peakier: log-probs react visibly to weight changes
    return sd


def _step(state: dict, names: list[str], seed: int, scale: float = 1.0) -> dict:
    """A new state where only ``names`` changed (noise of the tensor's own std times scale)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in state.items()}
    for n in names:
        sigma = max(float(out[n].std()), 0.1)  # norms start at all ones (std 0)
        out[n] = out[n] + scale * sigma * torch.randn(out[n].shape, generator=g)
    return out


class Publisher:
    """The trainer side of the weight interface, straight to the dataflow."""

    def __init__(self, url: str, full_every: int = 10):
        self.client = DataflowClient(url, retry_s=10)
        self.builder = ArtifactBuilder("policy", full_every=full_every)

    def publish(self, version: int, state: dict, full: bool | None = None):
        art = self.builder.build(version, state, full=full)
        for name, data in art.files.items():
            self.client.upload_weight_file("policy", version, name, data)
        self.client.publish(art.manifest)
        return art.manifest


class RecordingClient(DataflowClient):
    """A real client that remembers which weight files it downloaded."""

    downloads: list

    def download_weight_file(self, model_id, version, name):
        self.downloads.append((version, name))
        return super().download_weight_file(model_id, version, name)

    def download_weight_file_to(self, model_id, version, name, path):
        self.downloads.append((version, name))
        return super().download_weight_file_to(model_id, version, name, path)


def _recording_factory(url):
    downloads: list = []

    def make():
        c = RecordingClient(url, retry_s=10)
        c.downloads = downloads
        return c

    return make, downloads


def assert_engine_holds(engine, state: dict) -> None:
    """Every tensor vLLM computes with equals the trainer's bf16 cast of ``state``, bit for bit."""
    shapes = {n: list(t.shape) for n, t in state.items()}
    held = engine.held_weights(shapes)
    assert set(held) == set(state)
    bad = [n for n, t in state.items()
           if not torch.equal(held[n].view(torch.int16), t.to(torch.bfloat16).view(torch.int16))]
    assert not bad, f"vLLM holds other weights than published for {bad}"


def _reference_logprobs(model_dir, state, sequences, prompt_lens, temperature=1.0, bf16=True):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict({k: v.to(torch.bfloat16).float() if bf16 else v
                           for k, v in state.items()})
    out = []
    with torch.no_grad():
        for seq, p in zip(sequences, prompt_lens):
            logits = model(torch.tensor([seq])).logits[0].float()
            lp = torch.log_softmax(logits[:-1] / temperature, -1)
            out.append(lp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0][p - 1:].numpy())
    return out


def _logprob_gap(engine, model_dir, state, bf16=True) -> float:
    """max |vLLM log-prob - transformers log-prob on ``state``| over sampled completions
    (``state`` cast to bf16 first, unless ``bf16=False``)."""
    ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    comps = engine.generate_batch(ids, SamplingSpec(temperature=1.0, max_tokens=8, seed=5))
    seqs = [i + c.token_ids for i, c in zip(ids, comps)]
    ref = _reference_logprobs(model_dir, state, seqs, [len(i) for i in ids], bf16=bf16)
    return float(np.concatenate([np.abs(np.array(c.logprobs) - r) for c, r in zip(comps, ref)]).max())


def test_partial_push_updates_exactly_the_changed_modules(engine, tiny_model_dir, tmp_path,
                                                         dataflow_service):
    svc = dataflow_service(tmp_path)
    pub = Publisher(svc.url)
    factory, downloads = _recording_factory(svc.url)
    sync = WeightSync(factory, "policy", engine, check_interval_s=0.0, background=False)
    try:
        s1 = _state(seed=1)
        pub.publish(1, s1)
        sync.refresh()
        assert engine.version == 1 and sync.last_pushed == len(s1)  # the initial model: all
        assert_engine_holds(engine, s1)

        changed = [L0 + "self_attn.k_proj.weight", L1 + "self_attn.q_norm.weight",
                   L1 + "mlp.down_proj.weight"]
        s2 = _step(s1, changed, seed=2)
        m2 = pub.publish(2, s2)
        assert m2.kind == "delta" and m2.metadata["changed_tensors"] == 3
        sync.refresh()
        assert engine.version == 2 and sync.partial_pushes == 1
        # k_proj travels with q_proj and v_proj (one fused qkv_proj); q_norm and down_proj alone
        assert sync.last_pushed == 5
        assert downloads[-1] == (2, "delta.bin")
        assert_engine_holds(engine, s2)  # changed tensors updated, the other 20 untouched
        gap_new = _logprob_gap(engine, tiny_model_dir, s2)
        gap_old = _logprob_gap(engine, tiny_model_dir, s1)
        print(f"\npartial push: logprob |vLLM - HF(v2)| max {gap_new:.4f}, vs HF(v1) {gap_old:.4f}")
        assert gap_new < LOGPROB_ATOL
        assert gap_old > 3 * LOGPROB_ATOL  # the comparison discriminates: the change mattered
    finally:
        sync.close()
        pub.client.close()


class FlipOnceProxy(ShapedProxy):
    """Flips one byte inside the first delta file that crosses the link (towards the RaaS)."""

    flipped = 0

    def transform_down(self, data: bytes) -> bytes:
        at = data.find(MAGIC)
        if self.flipped or at < 0:
            return data
        self.flipped += 1
        pos = min(len(data) - 1, at + len(MAGIC) + 16)
        return data[:pos] + bytes([data[pos] ^ 0x40]) + data[pos + 1:]


def test_a_byte_flipped_on_the_wire_falls_back_to_a_full_pull(engine, tmp_path, dataflow_service,
                                                               caplog):
    svc = dataflow_service(tmp_path)
    pub = Publisher(svc.url)
    host_port = svc.url.removeprefix("http://")
    with FlipOnceProxy(host_port, mbit=1000, max_lifetime_s=120) as proxy:
        factory, downloads = _recording_factory(proxy.url)
        sync = WeightSync(factory, "policy", engine, check_interval_s=0.0, background=False)
        try:
            s1 = _state(seed=1)
            pub.publish(1, s1)
            sync.refresh()
            s2 = _step(s1, [L0 + "mlp.up_proj.weight"], seed=3)
            assert pub.publish(2, s2).kind == "delta"
            sync.refresh()
            assert proxy.flipped == 1
            assert sync.full_fallbacks == 1 and sync.failures == 0
            # delta (flipped, refused), then the full route: v1 full + v2 delta (intact)
            assert downloads == [(1, "model.safetensors"), (2, "delta.bin"),
                                 (1, "model.safetensors"), (2, "delta.bin")]
            assert engine.version == 2
            assert_engine_holds(engine, s2)
            reasons = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
            assert reasons and "sha256" in reasons[0]
        finally:
            sync.close()
            pub.client.close()


def test_a_delta_corrupt_in_the_store_keeps_the_engine_intact_until_the_next_full(
        engine, tmp_path, dataflow_service):
    svc = dataflow_service(tmp_path)
    pub = Publisher(svc.url)
    factory, downloads = _recording_factory(svc.url)
    sync = WeightSync(factory, "policy", engine, check_interval_s=0.0, background=False)
    try:
        s1 = _state(seed=1)
        pub.publish(1, s1)
        sync.refresh()
        s2 = _step(s1, [L1 + "self_attn.o_proj.weight"], seed=4)
        pub.publish(2, s2)
        path = tmp_path / "state" / "weights" / "policy" / "2" / "delta.bin"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
        path.write_bytes(bytes(data))
        sync.refresh()
        assert sync.full_fallbacks == 1 and sync.failures == 1 and "sha256" in sync.last_error
        assert engine.version == 1
        assert_engine_holds(engine, s1)  # nothing of the corrupt delta reached vLLM

        s3 = _step(s2, [L0 + "self_attn.v_proj.weight"], seed=5)
        s4 = _step(s3, ["lm_head.weight"], seed=6, scale=0.1)
        assert pub.publish(3, s3, full=True).kind == "full"
        assert pub.publish(4, s4).kind == "delta"
        downloads.clear()
        sync.refresh()
        assert downloads == [(3, "model.safetensors"), (4, "delta.bin")]
        assert engine.version == 4 and sync.failures == 1
        assert_engine_holds(engine, s4)
    finally:
        sync.close()
        pub.client.close()


def test_a_late_joiner_starts_from_the_last_full_then_follows_deltas(engine, tmp_path,
                                                                     dataflow_service):
    svc = dataflow_service(tmp_path)
    pub = Publisher(svc.url, full_every=3)
    states = [_state(seed=1)]
    for v in range(2, 6):  # 1 full, 2-3 deltas, 4 full, 5 delta
        states.append(_step(states[-1], [f"model.layers.{v % 2}.mlp.gate_proj.weight"], seed=v))
    for v, s in enumerate(states, start=1):
        pub.publish(v, s)
    factory, downloads = _recording_factory(svc.url)
    # a newcomer; large files streamed to disk (every file here)
    sync = WeightSync(factory, "policy", engine, check_interval_s=0.0, background=False,
                      download_dir=tmp_path / "dl", stream_min_bytes=0)
    try:
        sync.refresh()
        assert downloads == [(4, "model.safetensors"), (5, "delta.bin")]
        assert sync.full_pulls == 1 and sync.delta_pulls == 1 and sync.full_fallbacks == 0
        assert engine.version == 5
        assert_engine_holds(engine, states[-1])
        s6 = _step(states[-1], [L1 + "self_attn.k_norm.weight"], seed=6)
        pub.publish(6, s6)
        downloads.clear()
        sync.refresh()
        assert downloads == [(6, "delta.bin")] and sync.last_pushed == 1
        assert_engine_holds(engine, s6)
        assert list((tmp_path / "dl").iterdir()) == []  # streamed files removed once applied
    finally:
        sync.close()
        pub.client.close()


def test_a_float32_publication_reaches_a_float32_engine_exactly(tiny_model_dir, tmp_path,
                                                                dataflow_service):
    from astralight.raas.vllm_engine import VLLMEngine
    from astralight.weights.exact import split_fp32

    s1 = _state(seed=1)
    g = torch.Generator().manual_seed(7)
    # every weight moved by ~2^-11 of itself: under half a bf16 step, so bf16 rounds nearly
    # all of it away (what the default publication would have carried)
    s2 = {k: v * (1 + 2**-11 * torch.randn(v.shape, generator=g).clamp(-1, 1))
          for k, v in s1.items()}
    same_in_bf16 = sum(int(torch.eq(s2[k].to(torch.bfloat16), s1[k].to(torch.bfloat16)).sum())
                       for k in s1) / sum(v.numel() for v in s1.values())
    assert same_in_bf16 > 0.9
    eng = VLLMEngine(str(tiny_model_dir), dtype="float32", max_model_len=128, seed=0,
                     kv_cache_memory_bytes=64 << 20, enforce_eager=True, warmup=False)
    svc = dataflow_service(tmp_path)
    pub = Publisher(svc.url)
    sync = WeightSync(lambda: DataflowClient(svc.url, retry_s=10), "policy", eng,
                      check_interval_s=0.0, background=False)
    try:
        pub.publish(1, split_fp32(s1))
        sync.refresh()
        assert eng.version == 1 and sync.last_pushed == len(s1)  # weights, not halves
        assert pub.publish(2, split_fp32(s2)).kind == "delta"
        sync.refresh()
        assert eng.version == 2
        gap_new = _logprob_gap(eng, tiny_model_dir, s2, bf16=False)
        gap_old = _logprob_gap(eng, tiny_model_dir, s1, bf16=False)
        print(f"\nfloat32: logprob |vLLM - HF(v2)| max {gap_new:.2e}, vs HF(v1) {gap_old:.2e}")
        assert gap_new < 1e-4  # float32 arithmetic on the same weights
        assert gap_old > 10 * gap_new  # the sub-bf16 update reached the engine
    finally:
        sync.close()
        pub.client.close()
        eng.close()
