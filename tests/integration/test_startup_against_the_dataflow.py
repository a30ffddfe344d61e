"""Components started against a dataflow that is not there, or that refuses them, as real
processes: each says what it waits for and where, a SIGTERM ends the wait, and a RaaS whose
workflow is not the dataflow's ``workflow:`` is refused at registration and exits 2 (the
launcher restarts no component that exits 2) with both names and the key to change.

* ``astralight fit`` (tiny model) against a port nothing listens on: "waiting for the dataflow
  at URL (n s ...)" lines, then SIGTERM -- which Lightning alone would hold until the next step --
  ends it (exit 143, one line saying why);
* ``astralight raas serve`` (transformers engine: cheap to start) against nothing: the same
  lines from its registration, and SIGTERM ends it;
* a RaaS running ``single_turn`` against a real dataflow set to ``multi_turn``: 409 at
  registration, exit 2.

Waits are bounded (a process that never says or never exits fails the test) but no duration is
asserted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from astralight.dataflow.client import DataflowError
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
#: generous bounds for a loaded 2-core machine (model load, imports); never asserted on
SAY_WITHIN_S = 240.0
EXIT_WITHIN_S = 60.0


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ASTRALIGHT_TOKEN"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start(argv: list[str], log_path: Path, cwd: Path) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                cwd=cwd, env=_env())


def _wait_for_line(proc: subprocess.Popen, log_path: Path, needle: str) -> str:
    deadline = time.monotonic() + SAY_WITHIN_S
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if needle in text:
            return text
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    pytest.fail(f"never said {needle!r} (rc={proc.returncode}):\n"
                f"{log_path.read_text(errors='replace')[-4000:]}")


def _terminate(proc: subprocess.Popen, log_path: Path) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("SIGTERM did not end the process:\n"
                    f"{log_path.read_text(errors='replace')[-4000:]}")


def _raas_config(tmp_path: Path, model_dir, name: str) -> Path:
    config = {
        "engines": {"policy": {"class_path": "astralight.raas.hf_engine.HFEngine",
                               "init_args": {"model_path": str(model_dir)}}},
        "workflow": {"class_path": "astralight.workflows.single_turn.SingleTurnWorkflow",
                     "init_args": {"reward": {"class_path":
                                              "astralight.rewards.toy.ExactMatchReward"},
                                   "sampling": {"temperature": 1.0, "max_tokens": 3}}},
        "max_concurrency": 2, "poll_interval_s": 0.05, "progress_interval_s": 60.0, "seed": 0,
    }
    path = tmp_path / f"raas-{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_trainer_says_it_waits_for_the_dataflow_and_stops_on_sigterm(tmp_path, tiny_model_dir):
    url = f"http://127.0.0.1:{free_port()}"
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "default_root_dir": str(tmp_path / "run"),
                    "callbacks": [{"class_path": "astralight.callbacks.WeightPublisher",
                                   "init_args": {"every_n_steps": 1}}]},
        "model": {"class_path": "astralight.policy.M2POPolicy",
                  "init_args": {"model_path": str(tiny_model_dir), "model_id": "policy"}},
        "data": {"class_path": "astralight.datamodules.RolloutDataModule",
                 "init_args": {"dataflow_url": url, "model_id": "policy", "batch_size": 4}},
    }
    cfg = tmp_path / "trainer.yaml"
    cfg.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "trainer.log"
    proc = _start(["-m", "astralight.cli", "fit", "--config", str(cfg)], log_path, tmp_path)
    text = _wait_for_line(proc, log_path, f"waiting for the dataflow at {url} (")
    assert "ConnectError" in text.split(f"waiting for the dataflow at {url} (", 1)[1]
    rc = _terminate(proc, log_path)
    text = log_path.read_text(errors="replace")
    assert rc == 143, text[-3000:]  # 128 + SIGTERM: stopped, not crashed
    assert f"astralight fit: stopped: stopped waiting for the dataflow at {url} (SIGTERM" in text
    assert "Traceback" not in text


def test_a_raas_says_it_waits_for_the_dataflow_and_stops_on_sigterm(tmp_path, tiny_model_dir):
    url = f"http://127.0.0.1:{free_port()}"
    cfg = _raas_config(tmp_path, tiny_model_dir, "waiting")
    log_path = tmp_path / "raas.log"
    proc = _start(["-m", "astralight.raas.service", "--dataflow", url, "--config", str(cfg)],
                  log_path, tmp_path)
    text = _wait_for_line(proc, log_path, f"waiting for the dataflow at {url} (")
    # the registration waits dataflow_give_up_s (600 s by default), and says so
    assert "retrying for up to 600 s" in text
    _terminate(proc, log_path)
    assert "Traceback" not in log_path.read_text(errors="replace")


def test_a_raas_of_another_workflow_is_refused_and_exits_2(tmp_path, tiny_model_dir,
                                                           dataflow_service, client_for):
    url, _, _ = dataflow_service(tmp_path, workflow="multi_turn")
    # over HTTP: a registration naming another workflow is refused, naming both
    client = client_for(url)
    with pytest.raises(DataflowError) as info:
        client.register(["policy"], 2, meta={"workflow": "single_turn"})
    assert info.value.status == 409 and info.value.field == "workflow"
    assert client.stats()["instances"] == []

    cfg = _raas_config(tmp_path, tiny_model_dir, "refused")
    log_path = tmp_path / "raas-refused.log"
    proc = _start(["-m", "astralight.raas.service", "--dataflow", url, "--config", str(cfg)],
                  log_path, tmp_path)
    try:
        rc = proc.wait(timeout=SAY_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the refused RaaS did not exit:\n{log_path.read_text(errors='replace')}")
    text = log_path.read_text(errors="replace")
    assert rc == 2, text[-3000:]
    assert "refused this instance's registration" in text
    assert "'single_turn'" in text and "'multi_turn'" in text and "`workflow:`" in text
    assert "Traceback" not in text
