"""The custom-trainer example trains through ``astralight fit`` exactly as its README says.

``PYTHONPATH=examples/custom_trainer astralight fit --config examples/custom_trainer/trainer.yaml``
runs in a folder laid out like the repository root (``examples`` is a link to the real one, so
the config's relative ``runs/...`` paths land in the test's temporary folder), with command-line
overrides pointing it at a real dataflow service process and the tiny model. A thread plays the
RaaS (samples pushed through a ``DataflowClient``, as in test_trainer_dataflow.py). The
REINFORCE module named only by YAML ``class_path`` steps, publishes versions the service serves
back, and those weights differ from the initial ones; its baseline is in the checkpoint.
``--trainer.gradient_clip_val`` reaches the policy's own clip (Lightning refuses it under manual
optimization), and the TensorBoard folder has the policy entropy, no ``hp_metric`` and, from the
service's held-out eval, the table of sample completions (``eval/completions``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from astralight.dataflow.client import DataflowClient
from astralight.weights import WeightState
from tests.integration.service_helpers import fake_raas

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
BATCH = 8


def astralight_command() -> list[str]:
    """The installed ``astralight`` console script of this interpreter (as a user types it)."""
    script = Path(sys.executable).parent / "astralight"
    return [str(script)] if script.exists() else [sys.executable, "-m", "astralight.cli"]


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_reinforce_example_trains_through_astralight_fit(dataflow_service, tiny_model_dir,
                                                         tmp_path):
    service = dataflow_service(tmp_path, group_size=4, max_buffered_samples=32, eval={
        "source": {"class_path": "astralight.tasks.arithmetic.ArithmeticSource",
                   "init_args": {"split": "eval", "eval_size": 3, "max_operand": 9}},
        "every": STEPS, "k": 2})
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "examples").symlink_to(REPO / "examples", target_is_directory=True)

    stop, errors = threading.Event(), []
    raas = threading.Thread(target=fake_raas, args=(service.url, tiny_model_dir, stop, errors),
                            daemon=True)
    raas.start()
    env = {**os.environ, "PYTHONPATH": "examples/custom_trainer", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            [*astralight_command(), "fit", "--config", "examples/custom_trainer/trainer.yaml",
             f"--model.init_args.model_path={tiny_model_dir}",
             f"--data.init_args.dataflow_url={service.url}",
             f"--data.init_args.batch_size={BATCH}", "--data.init_args.max_wait_s=120",
             f"--trainer.max_steps={STEPS}", "--trainer.gradient_clip_val=0.5",
             # the last callback is the DataflowMonitor: it waits for the eval of the last
             # version (the fake RaaS answers eval tasks too), so its table is logged
             "--trainer.callbacks.init_args.wait_final_eval_s=300"],
            cwd=root, env=env, capture_output=True, text=True, timeout=600)
    finally:
        stop.set()
        raas.join(timeout=30)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert not errors, errors

    client = DataflowClient(service.url)
    stats = client.stats()["models"]["policy"]
    assert stats["batches_acked"] == STEPS and stats["samples_acked"] == STEPS * BATCH
    assert client.current_version("policy") == STEPS

    # the published chain (v1 full, then deltas), verified and applied as a RaaS does
    manifests = [client.latest_manifest("policy")]
    while manifests[0].kind == "delta":
        manifests.insert(0, client.manifest("policy", manifests[0].base_version))
    assert manifests[0].version == 1 and manifests[-1].version == STEPS
    ws = WeightState()
    for m in manifests:
        ws.apply(m, {name: client.download_weight_file("policy", m.version, name)
                     for name in m.files})
    client.close()
    published = ws.state
    initial = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    common = sorted(set(published) & set(initial))
    assert len(common) >= len(initial) - 1  # all of them (a tied lm_head may be dropped)
    changed = [n for n in common if not np.array_equal(published[n], bf16_bits(initial[n]))]
    assert len(changed) >= len(common) // 2, f"only {changed} changed"

    # the checkpoint (ModelCheckpoint, save_last) holds the same weights and the baseline state
    ckpt_path = root / "runs" / "custom_trainer" / "checkpoints" / "policy" / "last.ckpt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    state = ckpt["state_dict"]
    assert int(state["baseline_updates"]) == STEPS
    assert 0.0 < float(state["reward_ema"]) < 1.0  # rewards are 0/1, some of each
    assert ckpt["hyper_parameters"]["baseline_decay"] == 0.9
    assert ckpt["hyper_parameters"]["grad_clip"] == 0.5  # --trainer.gradient_clip_val
    for name in common:
        assert np.array_equal(published[name], bf16_bits(state[f"model.{name}"])), name

    # the objective's own metrics reached TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((root / "runs" / "custom_trainer" / "tensorboard").rglob("events.out.tfevents*"))
    assert events
    tags, texts = set(), set()
    for path in events:
        acc = EventAccumulator(str(path))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
        texts |= set(acc.Tags()["tensors"])
    assert {"train/reinforce_loss", "train/baseline", "train/grad_norm", "train/entropy",
            "eval/avg_at_k"} <= tags
    assert "hp_metric" not in tags
    assert any(t.startswith("eval/completions") for t in texts), texts
