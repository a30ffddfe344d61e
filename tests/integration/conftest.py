"""Integration fixtures: the real dataflow service as a subprocess on a free loopback port, a
client factory, and the FSDP2 fit tests' fixtures (``clean_dist``, ``batches``), shared here so
that tests never import fixtures from one another."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from astralight.launch.proc import stop_process
from tests.conftest import free_port

READY_LINE = "dataflow serving on http://"


class ServiceHandle(NamedTuple):
    url: str
    proc: subprocess.Popen
    config_path: Path


def _stop(proc: subprocess.Popen) -> None:
    stop_process(proc, timeout_s=15)


@pytest.fixture
def dataflow_service():
    """Factory: ``dataflow_service(tmp_path, token=None, **config_overrides) -> (url, proc, config_path)``.

    Writes ``tmp_path/dataflow-PORT.yaml`` (state_dir defaults to ``tmp_path/state``, so calling it
    again with the same ``tmp_path`` restarts on the same state), runs
    ``python -m astralight.dataflow.service --config ...`` with output in ``dataflow-PORT.log`` and
    waits for the readiness line. ``token`` sets ASTRALIGHT_TOKEN for the service only,
    ``env_extra`` more environment variables (e.g. PYTHONPATH for plugins in test files). Every
    process still running at teardown gets SIGTERM (then SIGKILL).
    """
    procs: list[subprocess.Popen] = []

    def start(tmp_path: Path, token: str | None = None, ready_timeout: float = 60.0,
              env_extra: dict | None = None, **overrides) -> ServiceHandle:
        tmp_path = Path(tmp_path)
        port = free_port()
        config = {"host": "127.0.0.1", "port": port, "state_dir": str(tmp_path / "state"),
                  "log_level": "INFO", **overrides}
        config_path = tmp_path / f"dataflow-{port}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log_path = tmp_path / f"dataflow-{port}.log"
        env = {k: v for k, v in os.environ.items() if k != "ASTRALIGHT_TOKEN"}
        if token:
            env["ASTRALIGHT_TOKEN"] = token
        env.update(env_extra or {})
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "astralight.dataflow.service", "--config", str(config_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        procs.append(proc)
        deadline = time.monotonic() + ready_timeout
        while True:
            text = log_path.read_text(errors="replace")
            if READY_LINE in text:
                url = text.split(READY_LINE, 1)[1].split()[0]
                return ServiceHandle(f"http://{url}", proc, config_path)
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc)
                raise RuntimeError(f"dataflow service did not become ready (rc={proc.returncode}):\n"
                                   f"{log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(0.05)

    yield start
    for proc in procs:
        _stop(proc)


@pytest.fixture
def client_for():
    """Factory: ``client_for(url, **kw) -> DataflowClient`` (retrying for 30 s by default),
    every client closed at teardown."""
    from astralight.dataflow.client import DataflowClient

    clients = []

    def make(url, **kw):
        c = DataflowClient(url, retry_s=kw.pop("retry_s", 30.0), **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


# ---------------------------------------------------------------- FSDP2 fits
# (test_fsdp2_fit.py, test_fsdp2_checkpoint.py, test_export.py)


@pytest.fixture
def clean_dist():
    """ModelParallelStrategy initialises a (world-size 1) gloo process group and sets
    MASTER_ADDR/PORT in this process: undo both so other tests see a clean process."""
    env = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture(scope="module")
def batches(tiny_model_dir):
    from astralight.datamodules import collate_batch
    from tests.fakes import FakeDataflowClient

    fake = FakeDataflowClient(tiny_model_dir, logprob_noise=0.3, seed=1)
    return [collate_batch(fake.make_batch(6)) for _ in range(2)]
