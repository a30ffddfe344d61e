"""In-process checks of the dataflow app that the subprocess tests cannot provoke: an unexpected
exception becomes a logged 500 JSON and the app keeps serving; config parsing from YAML + CLI."""

from __future__ import annotations

import pytest
import yaml
from fastapi.testclient import TestClient

from astralight.dataflow.app import create_app
from astralight.dataflow.config import DataflowConfig, parse_config


def test_unexpected_exception_is_a_500_json_and_the_app_keeps_serving(tmp_path, caplog):
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "state")), token="")

    def boom():
        raise RuntimeError("disk on fire")

    app.state.dataflow.stats = boom
    # (no token: the app answers loopback Host names only, so not TestClient's "testserver")
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
        r = client.get("/v1/stats")
        assert r.status_code == 500 and "disk on fire" in r.json()["error"]
        assert client.get("/v1/info").status_code == 200
    assert any("GET /v1/stats -> 500" in rec.getMessage() for rec in caplog.records)


def test_parse_config_reads_yaml_and_cli_overrides(tmp_path):
    path = tmp_path / "dataflow.yaml"
    path.write_text(yaml.safe_dump({"port": 9000, "model_ids": ["a", "b"], "queue_order": "edf",
                                    "eval": {"every": 3, "source": {
                                        "class_path": "astralight.tasks.arithmetic.ArithmeticSource",
                                        "init_args": {"split": "eval", "eval_size": 5}}}}))
    cfg = parse_config(["--config", str(path), "--port", "9001", "--eval.k", "2"])
    assert (cfg.port, cfg.model_ids, cfg.queue_order) == (9001, ["a", "b"], "edf")
    assert (cfg.eval.every, cfg.eval.k, cfg.eval.source["init_args"]["eval_size"]) == (3, 2, 5)
    assert cfg.host == "127.0.0.1"  # loopback by default


def test_bad_plugin_path_fails_at_start_naming_the_field(tmp_path):
    cfg = DataflowConfig(state_dir=str(tmp_path / "s"),
                         source={"class_path": "astralight.tasks.arithmetic.NoSuchSource"})
    with pytest.raises(ValueError, match="^source: "):
        create_app(cfg)
    with pytest.raises(SystemExit):
        parse_config(["--queue_order", "lifo"])


def test_client_gives_up_on_an_unreachable_service_after_retry_s():
    from astralight.dataflow.client import DataflowClient, DataflowUnreachable
    from tests.conftest import free_port

    client = DataflowClient(f"http://127.0.0.1:{free_port()}", retry_s=0.5)
    with pytest.raises(DataflowUnreachable) as info:
        client.info()
    assert info.value.status is None and "unreachable" in str(info.value)
    client.close()


def test_register_refuses_a_raas_of_another_workflow_with_409(tmp_path):
    """The RaaS sends its workflow's name; the route compares it with the dataflow's
    ``workflow:`` before anything is stored."""
    from astralight.protocol import decode, encode

    app = create_app(DataflowConfig(state_dir=str(tmp_path / "state"), workflow="single_turn"),
                     token="")
    headers = {"Content-Type": "application/msgpack"}
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
        body = {"model_ids": ["policy"], "capacity": 2, "instance_id": "raas-x",
                "meta": {"workflow": "multi_turn"}}
        r = client.post("/v1/register", content=encode(body), headers=headers)
        assert r.status_code == 409 and r.json()["field"] == "workflow"
        assert "'multi_turn'" in r.json()["error"] and "'single_turn'" in r.json()["error"]
        assert client.get("/v1/stats").json()["instances"] == []  # nothing was registered
        body["meta"] = {"workflow": "single_turn"}
        r = client.post("/v1/register", content=encode(body), headers=headers)
        assert r.status_code == 200 and decode(r.content)["instance_id"] == "raas-x"
