"""Every dataflow state has a run id: kept across restarts on it, new for a fresh ``state_dir``,
named by info, register, heartbeat and the version route (header and body), and a push naming
another run is refused whole (409 ``run_id``) before anything is stored."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from astralight.dataflow.app import create_app
from astralight.dataflow.client import DataflowError
from astralight.dataflow.config import DataflowConfig
from astralight.protocol import Sample
from tests.fakes import InProcessDataflow, app_client


def test_a_state_keeps_its_run_id_across_restarts_and_a_fresh_one_gets_another(tmp_path):
    first = InProcessDataflow.in_folder(tmp_path / "a")
    run = first.info()["run_id"]
    first.close()
    again = InProcessDataflow.in_folder(tmp_path / "a")  # a restart on the same state
    try:
        assert again.info()["run_id"] == run
        reply = again.register(["policy"], 1, "raas-x", {"workflow": "single_turn"})
        assert reply["run_id"] == run and again.heartbeat("raas-x")["run_id"] == run
    finally:
        again.close()
    fresh = InProcessDataflow.in_folder(tmp_path / "b")  # a restart on a fresh state_dir
    try:
        assert isinstance(run, str) and fresh.info()["run_id"] not in (run, None)
    finally:
        fresh.close()


def _sample(task_id: str) -> Sample:
    return Sample(task_id=task_id, sample_index=0, model_id="policy",
                  token_ids=np.array([3, 4], np.int32), logprobs=np.array([0, -1], np.float32),
                  loss_mask=np.array([0, 1], np.uint8), versions=np.array([-1, 0], np.int32),
                  reward=0.0, prompt_len=1)


def test_the_routes_name_the_run_and_refuse_a_push_made_for_another(tmp_path):
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "s"), group_size=2), token="")
    with TestClient(app, base_url="http://127.0.0.1") as http:
        client = app_client(http)
        run = client.info()["run_id"]
        assert client.current_version("policy") == 0 and client.run_id == run  # the header
        assert client.register(["policy"], 2, "raas-x",
                               {"workflow": "single_turn"})["run_id"] == run
        [task] = client.lease("raas-x", 1)
        client.push_run_id = "0123456789abcdef"  # samples made in another run
        with pytest.raises(DataflowError) as refused:
            client.push("raas-x", task.task_id, [_sample(task.task_id)])
        assert refused.value.status == 409 and refused.value.field == "run_id"
        assert run in refused.value.message and "0123456789abcdef" in refused.value.message
        [outcome] = client.push_many("raas-x", [(task.task_id, [_sample(task.task_id)])])
        assert isinstance(outcome, DataflowError)
        assert outcome.status == 409 and outcome.field == "run_id"
        assert client.stats()["models"]["policy"]["samples_accepted"] == 0
