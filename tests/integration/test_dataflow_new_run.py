"""A RaaS follows a dataflow restarted on a fresh state (a new run) on the same port.

The dataflow is the real service process on 127.0.0.1; the RaaS runs in this process with a
scripted engine (no model: the weights are small tensors, loaded by the real weight sync through
the real client), and a trainer-side client publishes versions. Run 1 reaches v3 and the RaaS
pushes at v3; the dataflow is stopped and started on another ``state_dir`` on the same port, and
the new run publishes its v1. The RaaS must drop the old run's weights and load v1 in full (not
wait for a v4), and every sample the new run accepts must be of v1; a push naming the old run is
refused (409 ``run_id``).
"""

from __future__ import annotations

import io
import sqlite3

import numpy as np
import pytest

from astralight.dataflow.client import DataflowClient, DataflowError
from astralight.engine import SamplingSpec
from astralight.protocol import Sample
from astralight.raas.config import RaaSConfig
from astralight.raas.service import RaaSService
from astralight.rewards.toy import ExactMatchReward
from astralight.trainer.tinymodel import build_tokenizer
from astralight.weights.artifacts import ArtifactBuilder
from astralight.workflows.single_turn import SingleTurnWorkflow
from tests.conftest import free_port
from tests.unit.engine_fakes import ScriptedEngine
from tests.unit.raas_fakes import states


def _publish(client, builder, version, state):
    art = builder.build(version, state)
    for name, data in art.files.items():
        client.upload_weight_file("policy", version, name, data)
    client.publish(art.manifest)


def _raas(url: str, engine) -> tuple[RaaSService, io.StringIO]:
    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(temperature=1.0,
                                                                      max_tokens=4))
    cfg = RaaSConfig(dataflow=url, engines={"policy": {"model_path": "unused"}}, workflow=wf,
                     model_ids=["policy"], max_concurrency=2, poll_interval_s=0.0,
                     progress_interval_s=1e9, weight_check_interval_s=3600.0,
                     heartbeat_interval_s=3600.0)
    out = io.StringIO()
    return RaaSService(cfg, client_factory=lambda: DataflowClient(url, retry_s=30),
                       engines={"policy": engine}, out=out), out


def _sample_versions(db) -> set[int]:
    conn = sqlite3.connect(str(db), timeout=10)
    try:
        return {r[0] for r in conn.execute("SELECT min_version FROM samples")}
    finally:
        conn.close()


def test_a_raas_follows_a_dataflow_restarted_on_a_fresh_state(tmp_path, dataflow_service):
    cfg = dict(port=free_port(), group_size=2, lease_seconds=60, max_inflight_tasks=8,
               max_buffered_samples=32)
    first = dataflow_service(tmp_path, state_dir=str(tmp_path / "s1"), **cfg)
    trainer = DataflowClient(first.url, retry_s=30)
    engine = ScriptedEngine(build_tokenizer(), ["82"], version=0)
    svc, out = _raas(first.url, engine)
    try:
        run_1 = trainer.info()["run_id"]
        builder = ArtifactBuilder("policy", full_every=10)
        for version, state in enumerate(states(3, seed=0), start=1):
            _publish(trainer, builder, version, state)
        svc.start()
        assert svc.run_id == run_1
        svc.syncs["policy"].refresh(force=True)
        assert engine.version == 3 and svc.run_cycle() == 2  # run 1: pushed at v3

        # ---- the same port, a fresh state_dir: a new run, whose trainer publishes v1
        first.proc.terminate()
        assert first.proc.wait(timeout=30) == 0
        second = dataflow_service(tmp_path, state_dir=str(tmp_path / "s2"), **cfg)
        assert second.url == first.url
        run_2 = trainer.info()["run_id"]
        assert run_2 != run_1
        _publish(trainer, ArtifactBuilder("policy"), 1, states(1, seed=1)[0])

        assert svc.run_cycle() == 0  # the lease: unknown instance -> rejoin, naming run 2
        assert svc.run_id == run_2
        assert svc.run_cycle() == 2  # resynced in full to run 2's v1, then leased and pushed
        assert engine.version == 1  # (before: held v3 and skipped "v1 is not newer")
        assert _sample_versions(tmp_path / "s2" / "dataflow.db") == {1}
        text = out.getvalue()
        assert f"the dataflow's run changed ({run_1} -> {run_2}" in text
        assert f"raas resynced to the dataflow's run {run_2}: policy=v1" in text

        # ---- a push naming the old run is refused whole, naming run_id
        stale = DataflowClient(first.url, retry_s=5)
        stale.push_run_id = run_1
        sample = Sample(task_id="train:9", sample_index=0, model_id="policy",
                        token_ids=np.array([3, 4], np.int32),
                        logprobs=np.array([0, -1], np.float32),
                        loss_mask=np.array([0, 1], np.uint8), versions=np.array([-1, 1], np.int32),
                        reward=0.0, prompt_len=1)
        with pytest.raises(DataflowError) as refused:
            stale.push(svc.instance_id, "train:9", [sample])
        stale.close()
        assert refused.value.status == 409 and refused.value.field == "run_id"
        assert run_1 in refused.value.message and run_2 in refused.value.message
    finally:
        svc.close()
        trainer.close()
