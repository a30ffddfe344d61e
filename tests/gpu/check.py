"""GPU check: the real-model path of astralight on one accelerator, measured, in minutes.

    python tests/gpu/check.py --device cuda                      # what tests/gpu/check.sh runs
    python tests/gpu/check.py --device cpu --tiny                # the same pipeline, tiny model, CPU

Nothing is downloaded (the GPU machine has no network either): every model is a random-initialised
Qwen3 of a real shape (Qwen3-0.6B and Qwen3-1.7B: hidden size, layers, heads, KV heads, head dim,
MLP size, vocabulary, tied embeddings), written locally as a Hugging Face folder with astralight's
tiny character tokenizer (token ids are generated directly, so its small vocabulary does not
matter; vLLM accepts any id below the model's vocabulary). Per model, in a child process:

1. ``build_model``: write the model folder (bf16 safetensors);
2. ``dataflow_start``: ``astralight dataflow serve`` on 127.0.0.1 (the weight store's HTTP face);
3. ``engine_start``: :class:`astralight.raas.vllm_engine.VLLMEngine`, as ``astralight raas serve``
   builds it (CUDA graphs on GPU unless ``--enforce-eager``); where vLLM is not installed
   (``--engine auto``), :class:`astralight.raas.hf_engine.HFEngine` (transformers, batched, KV
   cache) instead, and the record says so (``engine``, ``engine_note``): training, publication,
   download, verification and the in-place load are then checked, vLLM's CUDA path is not;
4. ``generate``: one batch of ``prompts x group`` rollouts at temperature 1.0 -> **throughput**;
5. ``train``: a Lightning ``Trainer.fit`` of :class:`astralight.policy.M2POPolicy` (the paper's
   A.7 settings: M2PO m2 0.01, KL 1e-3, AdamW 5e-6, wd 0.01, clip 1.0; bf16-mixed, FSDP2 on GPU:
   Lightning's ``ModelParallelStrategy``, the policy sharding itself per decoder layer)
   on batches built from those rollouts exactly as the trainer receives them
   (``single_turn.completion_sample`` -> group-normalised advantages -> ``collate_batch``), with
   the production :class:`astralight.callbacks.WeightPublisher` (encoder process, bf16 bit-diff
   deltas, upload to the dataflow) publishing every step: version 1 full, then deltas ->
   **delta sparsity and compression**; after each step the RaaS side,
   :class:`astralight.raas.weight_sync.WeightSync`, pulls the new version over HTTP, verifies it
   and loads it into the vLLM engine in place (``engine.update_weights`` through the worker
   extension, only the changed modules for a delta) -> **refresh pause** (the time the engine
   cannot generate), then checks a few tensors the engine holds against the published bits and
   generates again;
6. ``lora_train`` (``--lora-steps``, default 2): M2PO steps on a peft LoRA adapter under the same
   strategy (FSDP2 on GPU), publishing the adapter (full, then delta) -> the ``lora`` record.

Prints ONE JSON line on stdout: the headline figures of the largest model that completed
(``throughput_tokens_per_s``, ``refresh_pause_s`` (median delta refresh), ``refresh_full_pause_s``,
``delta_sparsity``, ``delta_compression``, ``steps_s`` (seconds per optimizer step),
``timings`` (seconds per stage)) and ``models`` with every model's full record. Progress goes to
stderr. A stage that fails is recorded (``error``) with the figures of the stages before it.
Within ``--budget-s`` (default 450 s: one H200 must finish in under 8 minutes), a model that would
start with less than a minute left is skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

#: real shapes (the published config.json of each model); vocabulary and tied embeddings included
SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, tie_word_embeddings=True),
}
#: sizes of the work per device; the CPU profile keeps the tiny pipeline under a minute
PROFILES = {
    "cuda": dict(prompts=64, group=8, prompt_len=256, max_tokens=512, steps=3, batch=32,
                 micro_batch=8, lr=5e-6, precision="bf16-mixed", strategy="fsdp2",
                 gpu_memory_utilization=0.35, gradient_checkpointing=True),
    "cpu": dict(prompts=8, group=4, prompt_len=8, max_tokens=16, steps=3, batch=16,
                micro_batch=8, lr=1e-5, precision="32-true", strategy="auto",
                gpu_memory_utilization=None, gradient_checkpointing=False),
}
MODEL_ID = "policy"
LORA_MODEL_ID = "policy_lora"  # the LoRA stage publishes adapters under a model id of its own
LORA = dict(r=16, alpha=32.0, dropout=0.0, publish="adapter")
HEADLINE = ("engine", "throughput_tokens_per_s", "refresh_pause_s", "refresh_full_pause_s", "delta_sparsity",
            "delta_compression", "steps_s", "timings")


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- model folders


def build_model_folder(name: str, path: Path, seed: int = 0) -> Path:
    """A random-initialised Qwen3 folder of ``name``'s real shape (or the tiny model)."""
    from astralight.trainer.tinymodel import build_tiny_model_folder, build_tokenizer

    if name == "tiny":
        return build_tiny_model_folder(path)
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[name], max_position_embeddings=40960, rope_theta=1_000_000.0,
                         rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config.architectures = ["Qwen3ForCausalLM"]
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Qwen3ForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for n, shape in shapes.items():  # Qwen3's init: normal(0, 0.02), RMSNorm weights 1
        if n.endswith("norm.weight"):
            tensors[n] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[n] = torch.empty(shape).normal_(0.0, 0.02, generator=gen).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    save_model_folder_tokenizer(path, build_tokenizer())
    return path


def save_model_folder_tokenizer(path: Path, tokenizer) -> None:
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2}))


# ---------------------------------------------------------------------------- dataflow service


def start_dataflow(workdir: Path, timeout_s: float = 120.0):
    """``astralight dataflow serve`` on a free loopback port; returns (url, process)."""
    cfg = workdir / "dataflow.yaml"
    cfg.write_text(json.dumps({"host": "127.0.0.1", "port": 0, "model_ids": [MODEL_ID, LORA_MODEL_ID],
                               "state_dir": str(workdir / "dataflow"), "log_level": "WARNING"}))
    log_path = workdir / "dataflow.log"
    env = {k: v for k, v in os.environ.items() if k != "ASTRALIGHT_TOKEN"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "astralight.cli", "dataflow", "serve",
                                 "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=workdir)
    deadline = time.monotonic() + timeout_s
    ready = "dataflow serving on http://"
    while True:
        text = log_path.read_text(errors="replace")
        if ready in text:
            os.environ.pop("ASTRALIGHT_TOKEN", None)  # this process's clients: no token either
            return "http://" + text.split(ready, 1)[1].split()[0], proc
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the dataflow service did not start:\n{text[-3000:]}")
        time.sleep(0.05)


def stop(proc) -> None:
    from astralight.launch.proc import stop_process

    stop_process(proc)


# ---------------------------------------------------------------------------- rollouts -> batches


def make_batches(completions, prompts, group: int, batch: int, steps: int, seed: int) -> list[dict]:
    """Trainer batches from real rollouts, built the way the dataflow and the datamodule do:
    samples by ``completion_sample``, a seeded 0/1 reward per sample, group-normalised advantages
    (per prompt), ``collate_batch``."""
    import numpy as np
    import torch

    from astralight.datamodules.rollout import collate_batch
    from astralight.protocol import Batch, Task
    from astralight.rl.advantages import group_normalized_advantages
    from astralight.workflows.single_turn import completion_sample

    rng = np.random.default_rng(seed)
    samples = []
    for g, prompt_ids in enumerate(prompts):
        task = Task(task_id=f"check-{g}", prompt=list(prompt_ids), n=group, model_ids=[MODEL_ID])
        rewards = rng.integers(0, 2, size=group).astype(float)
        if rewards.min() == rewards.max():  # keep every group informative (as dynamic sampling)
            rewards[0] = 1.0 - rewards[0]
        adv = group_normalized_advantages(torch.tensor(rewards), [0] * group).tolist()
        for i in range(group):
            comp = completions[g * group + i]
            s = completion_sample(task, MODEL_ID, i, i, list(prompt_ids), comp, 0,
                                  float(rewards[i]), 1.0)
            s.advantage = float(adv[i])
            samples.append(s)
    out = []
    for k in range(steps):
        chunk = [samples[(k * batch + j) % len(samples)] for j in range(batch)]
        out.append(collate_batch(Batch(batch_id=f"check-b{k}", model_id=MODEL_ID,
                                       policy_version=0, samples=chunk)))
    return out


# ---------------------------------------------------------------------------- the check of one model


class Recorder:
    """Collects one model's figures and rewrites its JSON file after every stage, so a later
    failure (or the parent's timeout) keeps everything measured before it."""

    def __init__(self, out: Path | None, **fields):
        self.out = out
        self.data = {**fields, "timings": {}, "ok": False}
        self.t0 = time.perf_counter()

    def save(self) -> None:
        self.data["wall_s"] = round(time.perf_counter() - self.t0, 3)
        if self.out is not None:
            tmp = self.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, default=_jsonable))
            tmp.replace(self.out)

    @contextmanager
    def stage(self, name: str):
        say(f"{self.data['model']}: {name} ...")
        t = time.perf_counter()
        try:
            yield
        finally:
            self.data["timings"][name] = round(time.perf_counter() - t, 4)
            say(f"{self.data['model']}: {name} {self.data['timings'][name]:.2f} s")
            self.save()


def _jsonable(obj):
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def _finite(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def run_model(name: str, device: str, workdir: Path, rec: Recorder, args) -> None:
    import torch

    prof = dict(PROFILES[device])
    if name == "tiny":  # its context is 128 tokens: the CPU profile's sizes on any device
        prof.update({k: PROFILES["cpu"][k] for k in ("prompts", "group", "prompt_len",
                                                     "max_tokens", "batch", "micro_batch", "lr")})
    if device == "cpu":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as astralight raas serve
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    dataflow = engine = sync = None
    try:
        with rec.stage("build_model"):
            folder = build_model_folder(name, workdir / "model")
            rec.data["model_bytes"] = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        with rec.stage("dataflow_start"):
            url, dataflow = start_dataflow(workdir)

        from astralight.engine import SamplingSpec

        prompt_len, max_tokens, group = prof["prompt_len"], prof["max_tokens"], prof["group"]
        kind, why = choose_engine(args.engine)
        rec.data["engine"] = kind
        if why:
            rec.data["engine_note"] = why
            say(f"{name}: {why}")
        with rec.stage("engine_start"):
            if kind == "vllm":
                from astralight.raas.vllm_engine import VLLMEngine

                kw = dict(model_path=str(folder), dtype="bfloat16", seed=0,
                          max_model_len=prompt_len + max_tokens + 8)
                if device == "cuda":
                    kw["gpu_memory_utilization"] = prof["gpu_memory_utilization"]
                    if args.enforce_eager:
                        kw["enforce_eager"] = True
                else:
                    kw["kv_cache_memory_bytes"] = 256 << 20
                engine = VLLMEngine(**kw)
                rec.data["vllm_start_s"] = round(engine.start_s, 3)
                rec.data["vllm_warmup_s"] = round(engine.warmup_s, 3)
            else:
                from astralight.raas.hf_engine import HFEngine

                engine = HFEngine(str(folder), seed=0, max_model_len=prompt_len + max_tokens + 8,
                                  device=device, dtype="bfloat16" if device == "cuda" else "float32",
                                  batch_size=args.hf_batch_size)
                rec.data["hf_start_s"] = round(engine.start_s, 3)

        vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
                   for _ in range(prof["prompts"])]
        requests = [p for p in prompts for _ in range(group)]
        # unseeded: an engine may batch unseeded requests together (a seeded one is its own)
        sampling = SamplingSpec(temperature=1.0, max_tokens=max_tokens)
        with rec.stage("generate"):
            t = time.perf_counter()
            completions = engine.generate_batch(requests, sampling)
            gen_s = time.perf_counter() - t
        n_tokens = sum(len(c.token_ids) for c in completions)
        rec.data.update(generated_sequences=len(completions), generated_tokens=n_tokens,
                        prompt_tokens=len(requests) * prompt_len,
                        throughput_tokens_per_s=round(n_tokens / gen_s, 2),
                        throughput_prompt_and_generated_tokens_per_s=round(
                            (n_tokens + len(requests) * prompt_len) / gen_s, 2))
        rec.save()

        batches = make_batches(completions, prompts, group, prof["batch"], prof["steps"], seed=2)
        from astralight.dataflow.client import DataflowClient
        from astralight.raas.weight_sync import WeightSync

        sync = WeightSync(lambda: DataflowClient(url, timeout=900.0, retry_s=30.0), MODEL_ID,
                          engine, background=False, download_dir=workdir / "downloads")
        check_prompts = [prompts[0][:prompt_len]] * 4
        refreshes: list[dict] = []

        def refresh(version: int) -> None:
            failures = sync.failures
            pause = sync.refresh(force=True)
            event = dict(sync.events[-1]) if sync.events else {}
            entry = {"version": version, "engine_version": int(engine.version),
                     "route": event.get("route"), "fetched_bytes": event.get("bytes"),
                     "fetch_s": _round(event.get("seconds")), "pause_s": _round(pause),
                     "tensors_pushed": sync.last_pushed,
                     "tensors_total": len(sync.state.state or {}),
                     "error": sync.last_error if sync.failures > failures else None}
            if entry["error"] is None and sync.state.state:
                try:
                    entry["verified_tensors"] = verify_engine(engine, sync)
                except Exception as exc:  # noqa: BLE001 - reported; the figures still count
                    entry["verified_tensors"] = 0
                    entry["verify_error"] = f"{type(exc).__name__}: {exc}"
                t = time.perf_counter()
                engine.generate_batch(check_prompts, SamplingSpec(temperature=1.0, max_tokens=8))
                entry["generate_after_refresh_s"] = _round(time.perf_counter() - t)
            refreshes.append(entry)
            rec.data["refreshes"] = refreshes
            say(f"{name}: refresh v{version}: {entry}")

        attempts = [dict(strategy=args.strategy or prof["strategy"], kl_coef=0.001)]
        if device == "cuda":  # a failing FSDP2/KL path must not cost the figures that follow it
            attempts.append(dict(strategy="auto", kl_coef=0.0))
        publisher = None
        for i, settings in enumerate(attempts):
            try:
                with rec.stage("train" if i == 0 else "train_fallback"):
                    publisher, probe = fit(folder, url, batches, prof, device, settings, refresh,
                                           workdir / f"trainer{i}")
                rec.data["train_settings"] = settings
                break
            except Exception as exc:  # noqa: BLE001 - recorded, then the fallback
                rec.data.setdefault("train_errors", []).append(
                    {"settings": settings, "error": f"{type(exc).__name__}: {exc}",
                     "trace": traceback.format_exc()[-4000:]})
                rec.save()
                say(f"{name}: training with {settings} failed: {exc}")
                if i + 1 == len(attempts):
                    raise
                # start over: a fresh weight store (the next attempt publishes from version 1),
                # a fresh shadow copy, the engine's weights counted as unknown (version 0)
                sync.close()
                stop(dataflow)
                fresh = workdir / f"retry{i + 1}"
                fresh.mkdir()
                url, dataflow = start_dataflow(fresh)
                sync = WeightSync(lambda: DataflowClient(url, timeout=900.0, retry_s=30.0),
                                  MODEL_ID, engine, background=False,
                                  download_dir=workdir / "downloads")
                engine.version = 0
                refreshes.clear()
                if device == "cuda":
                    torch.cuda.empty_cache()

        # the publisher's per-version records (artifact_record: kind 1 = full, 0 = delta)
        records = [{**{k: _finite(v) for k, v in r.items()},
                    "kind": "full" if r.get("kind") == 1.0 else "delta"} for r in publisher.history]
        rec.data["published"] = records
        rec.data["steps_s"] = [round(s, 4) for s in probe.step_s]
        rec.data["step_s_median"] = round(statistics.median(probe.step_s), 4)
        rec.data["train_metrics"] = probe.metrics
        deltas = [r for r in records if r.get("kind") == "delta"]
        fulls = [r for r in records if r.get("kind") == "full"]
        if deltas:
            rec.data["delta_sparsity"] = round(statistics.mean(r["sparsity"] for r in deltas), 6)
            rec.data["delta_compression"] = round(
                statistics.mean(r["compression_ratio"] for r in deltas), 3)
            rec.data["delta_bytes"] = [r["bytes"] for r in deltas]
        if fulls:
            rec.data["full_bytes"] = fulls[0]["bytes"]
        ok_refresh = [r for r in refreshes if r["error"] is None and r["pause_s"] is not None]
        delta_pauses = [r["pause_s"] for r in ok_refresh if r["route"] == "delta"]
        full_pauses = [r["pause_s"] for r in ok_refresh if r["route"] == "full"]
        rec.data["refresh_pause_s"] = _round(statistics.median(delta_pauses)) if delta_pauses else None
        rec.data["refresh_full_pause_s"] = _round(full_pauses[0]) if full_pauses else None
        rec.data["refresh_verified"] = bool(ok_refresh) and all(
            r.get("verified_tensors", 0) > 0 for r in ok_refresh)
        rec.data["ok"] = bool(deltas) and bool(delta_pauses)
        rec.save()
        if args.lora_steps > 0:
            run_lora(folder, url, batches[:args.lora_steps], prof, device,
                     rec.data["train_settings"], workdir, rec)
    except Exception as exc:  # noqa: BLE001 - the record says what failed and keeps the rest
        rec.data["error"] = f"{type(exc).__name__}: {exc}"
        rec.data["trace"] = traceback.format_exc()[-4000:]
        say(f"{name}: FAILED: {rec.data['error']}")
    finally:
        with rec.stage("teardown"):
            if sync is not None:
                sync.close()
            if engine is not None:
                try:
                    engine.close()
                except Exception as exc:  # noqa: BLE001
                    say(f"engine close: {exc}")
            stop(dataflow)


def _round(x, n: int = 4):
    return None if x is None else round(float(x), n)


def choose_engine(wanted: str) -> tuple[str, str | None]:
    """``(kind, note)``: vLLM when asked for or installed; otherwise the transformers engine
    (:class:`astralight.raas.hf_engine.HFEngine`, batched with a KV cache), with a note saying
    why, so that a machine without vLLM still checks training, publication and the refresh."""
    import importlib.util

    if wanted == "hf":
        return "hf", None
    if importlib.util.find_spec("vllm") is not None:
        return "vllm", None
    if wanted == "vllm":
        raise RuntimeError("--engine vllm: vLLM is not installed here (pip install 'astralight[vllm]')")
    return "hf", ("vLLM is not installed here: rollouts and refreshes use the transformers engine "
                  "(HFEngine); the throughput is not vLLM's")


def verify_engine(engine, sync, limit: int = 3) -> int:
    """Compare a few tensors the engine computes with against the verified published bits
    (bit for bit); raise on a mismatch; return how many were compared."""
    import torch

    table = sync.state.manifest.tensors
    names = [n for n in table if n.endswith(("q_proj.weight", "down_proj.weight", "norm.weight"))]
    names = (names[:1] + names[-2:])[:limit] or list(table)[:limit]
    held = engine.held_weights({n: table[n]["shape"] for n in names})
    want = sync.state.tensors(names)
    for n in names:
        if n not in held or not torch.equal(held[n].cpu().to(torch.bfloat16), want[n].cpu()):
            raise RuntimeError(f"the engine's {n} differs from published v{sync.state.version}")
    return len(names)


def run_lora(folder: Path, url: str, batches: list[dict], prof: dict, device: str,
             settings: dict, workdir: Path, rec) -> None:
    """The ``lora`` stage: M2PO steps on a peft LoRA adapter (:data:`LORA`, every linear layer
    of the decoder) under the strategy the main stage trained with (FSDP2 on GPU), publishing
    the adapter (version 1 full, then bf16 deltas). Each published manifest is read back from
    the dataflow: adapter metadata present, only adapter tensors named. Recorded under
    ``lora`` (``ok``, ``error``); it does not change the main record's ``ok``."""
    from astralight.dataflow.client import DataflowClient

    lora: dict = {"settings": settings, "config": LORA, "ok": False}
    rec.data["lora"] = lora
    client = DataflowClient(url, timeout=900.0)

    def check_manifest(version: int) -> None:
        manifest = client.manifest(LORA_MODEL_ID, version)
        names = list(manifest.tensors)
        adapter = (manifest.metadata or {}).get("adapter") or {}
        if adapter.get("type") != "lora" or not names or not all(".lora_" in n for n in names):
            raise RuntimeError(f"v{version} of {LORA_MODEL_ID} is not an adapter: "
                               f"metadata {manifest.metadata!r}, tensors {names[:3]}")
        lora.setdefault("manifests", []).append({"version": version, "tensors": len(names)})

    try:
        with rec.stage("lora_train"):
            publisher, probe = fit(folder, url, batches, prof, device, settings, check_manifest,
                                   workdir / "trainer_lora", model_id=LORA_MODEL_ID, lora=LORA)
        records = [{**{k: _finite(v) for k, v in r.items()},
                    "kind": "full" if r.get("kind") == 1.0 else "delta"} for r in publisher.history]
        lora.update(published=records, steps_s=[round(x, 4) for x in probe.step_s],
                    train_metrics=probe.metrics,
                    ok=bool(records) and len(lora.get("manifests", [])) == len(batches))
    except Exception as exc:  # noqa: BLE001 - recorded; the main figures stand
        lora.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-4000:])
        say(f"lora: FAILED: {lora['error']}")
    finally:
        client.close()
        rec.save()


def fit(folder: Path, url: str, batches: list[dict], prof: dict, device: str, settings: dict,
        refresh, root: Path, model_id: str = MODEL_ID, lora: dict | None = None):
    """``Trainer.fit`` of M2POPolicy with the production WeightPublisher; after every step the
    probe waits for the publication and runs the RaaS refresh."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from astralight.callbacks import WeightPublisher
    from astralight.policy import M2POPolicy

    class Probe(pl.Callback):
        def __init__(self, publisher):
            self.publisher, self.step_s, self.metrics, self._t = publisher, [], {}, 0.0

        def _sync(self):
            if device == "cuda":
                torch.cuda.synchronize()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._sync()
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._sync()
            self.step_s.append(time.perf_counter() - self._t)
            self.metrics = {k: round(float(v), 6) for k, v in trainer.callback_metrics.items()
                            if k.startswith("train/")}
            if not self.publisher.flush(900):
                raise RuntimeError("the publication of this step did not finish in 900 s")
            if self.publisher.errors:
                raise RuntimeError(f"publication failed: {self.publisher.last_error}")
            refresh(trainer.global_step)

    strategy = settings["strategy"]
    if strategy in ("fsdp2", "fsdp"):  # FSDP2; "fsdp" kept as an alias (FSDP1 is refused)
        from astralight.trainer.fsdp2_strategy import FSDP2Strategy

        strategy = FSDP2Strategy(data_parallel_size=1, tensor_parallel_size=1)
    publisher = WeightPublisher(dataflow_url=url, every_n_steps=1, full_every=10)
    probe = Probe(publisher)
    module = M2POPolicy(model_path=str(folder), model_id=model_id, loss="m2po", m2_threshold=0.01,
                        kl_coef=settings["kl_coef"], lr=prof["lr"], weight_decay=0.01,
                        betas=(0.9, 0.999), warmup_steps=0, grad_clip=1.0,
                        normalize_advantages=True, temperature=1.0,
                        micro_batch_size=prof["micro_batch"],
                        gradient_checkpointing=prof["gradient_checkpointing"], lora=lora)
    if model_id != MODEL_ID:
        batches = [{**b, "model_id": model_id} for b in batches]
    trainer = pl.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1,
                         strategy=strategy, precision=prof["precision"], max_steps=len(batches),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=str(root), callbacks=[publisher, probe])
    loader = DataLoader(batches, batch_size=None, collate_fn=_identity)
    trainer.fit(module, train_dataloaders=loader)
    if len(probe.step_s) != len(batches):
        raise RuntimeError(f"{len(probe.step_s)} of {len(batches)} steps ran")
    return publisher, probe


def _identity(x):
    return x


# ---------------------------------------------------------------------------- orchestration


def child_main(args) -> int:
    out = Path(args.out)
    workdir = Path(tempfile.mkdtemp(prefix=f"astralight-gpu-check-{args.model}-",
                                    dir=args.workdir))
    rec = Recorder(out, model=args.model, device=args.device)
    try:
        run_model(args.model, args.device, workdir, rec, args)
    finally:
        rec.save()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    sys.stderr.flush()
    os._exit(0)  # vLLM's exit handlers can hang on a closed engine; the record is written


def parent_main(args) -> int:
    t0 = time.monotonic()
    models = ["tiny"] if args.tiny else [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m != "tiny" and m not in SHAPES]
    if unknown:
        print(f"--models: unknown {unknown}; known: {sorted(SHAPES)}", file=sys.stderr)
        return 2
    summary: dict = {"device": args.device, "models": {}, "budget_s": args.budget_s}
    if args.device == "cuda":
        summary["gpu"] = _gpu_name()
    tmp = Path(tempfile.mkdtemp(prefix="astralight-gpu-check-", dir=args.workdir))
    active: dict = {}

    def on_term(signum, frame):  # an outer timeout: stop the model running, report what we have
        raise _Stopped(f"stopped by signal {signum}")

    import signal

    signal.signal(signal.SIGTERM, on_term)
    try:
        for name in models:
            left = args.budget_s - (time.monotonic() - t0)
            if left < args.min_model_s:
                summary["models"][name] = {"model": name, "skipped": f"{left:.0f} s of budget left"}
                say(f"{name}: skipped, {left:.0f} s of budget left")
                continue
            out = tmp / f"{name}.json"
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", name,
                   "--device", args.device, "--out", str(out)]
            if args.enforce_eager:
                cmd.append("--enforce-eager")
            cmd += ["--engine", args.engine, "--hf-batch-size", str(args.hf_batch_size),
                    "--lora-steps", str(args.lora_steps)]
            if args.strategy:
                cmd += ["--strategy", args.strategy]
            if args.workdir:
                cmd += ["--workdir", args.workdir]
            if args.keep:
                cmd.append("--keep")
            say(f"{name}: starting (budget left {left:.0f} s)")
            active.update(name=name, out=out)
            # its own process group, so that a timeout stops vLLM's and the encoder's processes too
            proc = active["proc"] = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr,
                                                     start_new_session=True)
            try:
                proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
            summary["models"][name] = _child_result(name, out, proc, args.budget_s)
            active.clear()
    except _Stopped as exc:
        if active:
            _kill_group(active["proc"])
            result = _child_result(active["name"], active["out"], active["proc"], args.budget_s)
            result["error"] = result.get("error") or str(exc)
            summary["models"][active["name"]] = result
    done = [r for r in summary["models"].values() if r.get("ok")]
    primary = done[-1] if done else next(
        (r for r in reversed(list(summary["models"].values())) if "timings" in r), {})
    summary["model"] = primary.get("model")
    for key in HEADLINE:
        summary[key] = primary.get(key)
    summary["ok"] = bool(done) and len(done) == len(models)
    summary["total_s"] = round(time.monotonic() - t0, 2)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(summary, default=_jsonable), flush=True)
    return 0 if summary["ok"] else 1


class _Stopped(Exception):
    """SIGTERM reached the parent (e.g. check.sh's outer timeout)."""


def _child_result(name: str, out: Path, proc, budget_s: float) -> dict:
    """The child's record (partial when it failed or was stopped) with why it ended."""
    try:
        result = json.loads(out.read_text()) if out.exists() else {"model": name}
    except ValueError:
        result = {"model": name}
    if proc.returncode is None or proc.returncode < 0:
        result.setdefault("error", f"stopped at the budget ({budget_s:.0f} s)")
    elif proc.returncode != 0:
        result.setdefault("error", f"the check process ended with status {proc.returncode}")
    return result


def _kill_group(proc) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny model (for --device cpu)")
    p.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b",
                   help=f"comma-separated, smallest first; known: {', '.join(SHAPES)}")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="stop starting models after this long; a running one is stopped at it")
    p.add_argument("--min-model-s", type=float, default=60.0,
                   help="do not start a model with less budget than this left")
    p.add_argument("--strategy", choices=("fsdp2", "fsdp", "auto"), default=None,
                   help="trainer strategy: fsdp2 (Lightning's ModelParallelStrategy, the policy "
                        "sharding itself with fully_shard; 'fsdp' is an alias) or auto "
                        "(default: fsdp2 on cuda, auto on cpu)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="vLLM without CUDA graphs (faster start, lower throughput)")
    p.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto",
                   help="rollout engine: vLLM, or transformers' (HFEngine) where vLLM is not "
                        "installed (auto: vLLM if importable)")
    p.add_argument("--hf-batch-size", type=int, default=256,
                   help="sequences per forward pass of the transformers engine")
    p.add_argument("--lora-steps", type=int, default=2,
                   help="M2PO steps of the LoRA stage (peft adapter, same strategy; 0: skip it)")
    p.add_argument("--workdir", default=None, help="where model folders and state go (default: /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the model folders, state and records")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.tiny and args.device == "cuda" and not args.child:
        say("--tiny on cuda: the tiny model on the GPU")
    if args.child:
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
