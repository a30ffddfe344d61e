"""A table of sample completions per evaluated version (issue 19, item 16).

- the dataflow keeps a bounded few per version (:class:`CompletionLog`: one per prompt, the
  first prompts reported, the newest versions), serves them at
  ``GET /v1/eval/{model_id}/{version}/completions`` (limit checked) and the client reads them;
- ``DataflowMonitor`` logs them once per evaluated version, at the version's step: a table to a
  logger with W&B's ``log_table``, markdown text to TensorBoard's ``add_text``, nothing to other
  loggers; completions sent as token ids are decoded with the policy's tokenizer; an older
  service without the route turns the table off and monitoring goes on.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
from fastapi.testclient import TestClient

from astralight.callbacks.eval_table import markdown_table, table_rows
from astralight.dataflow.app import create_app
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.evals import COMPLETION_TEXT_CHARS, CompletionLog
from astralight.protocol import Sample
from tests.unit.dataflow_fakes import publish, samples
from tests.unit.monitor_fakes import RecordingLogger, TableLogger, TextLogger, monitor_with

EVAL = {"source": {"class_path": "astralight.tasks.arithmetic.ArithmeticSource",
                   "init_args": {"split": "eval", "eval_size": 3, "max_operand": 9}},
        "every": 1, "k": 2}


def sample(reward: float, text: str | None = None, attempt: int = 0, index: int = 0) -> Sample:
    meta = {"finish_reason": "stop", "attempt": attempt}
    if text is not None:
        meta["completion"] = text
    return Sample(task_id="t", sample_index=index, model_id="policy",
                  token_ids=np.array([5, 6, 7, 8], np.int32),
                  logprobs=np.array([0, -1, -1, -1], np.float32),
                  loss_mask=np.array([0, 1, 1, 1], np.uint8),
                  versions=np.array([-1, 3, 3, 4], np.int32), reward=reward, metadata=meta)


# ----------------------------------------------------------------------------- the dataflow side


def test_the_log_keeps_one_first_attempt_per_prompt_and_is_bounded():
    log = CompletionLog(per_version=2, max_versions=2)
    log.add("policy", 4, 0, "1+2=", [sample(0.0, "4", attempt=1, index=0),
                                     sample(1.0, "3", index=1)])
    log.add("policy", 4, 0, "1+2=", [sample(0.0, "again")])  # the same prompt again: ignored
    log.add("policy", 4, 1, [{"role": "user", "content": "2+2="}], [sample(0.0)])
    log.add("policy", 4, 2, "third", [sample(1.0, "x")])  # beyond per_version
    (first, second) = log.get("policy", 4)
    assert (first["prompt"], first["completion"], first["reward"], first["correct"]) == \
        ("1+2=", "3", 1.0, True)  # the first attempt, not the retry
    assert (first["min_version"], first["max_version"], first["finish_reason"]) == (3, 4, "stop")
    assert first["completion_ids"] is None
    # no text from the workflow: the generated token ids, for the trainer to decode
    assert second["completion"] is None and second["completion_ids"] == [6, 7, 8]
    assert second["prompt"] == "user: 2+2="
    assert log.get("policy", 4, limit=1) == [first]
    log.add("policy", 5, 0, "p", [sample(1.0, "y" * (COMPLETION_TEXT_CHARS + 50))])
    assert len(log.get("policy", 5)[0]["completion"]) == COMPLETION_TEXT_CHARS
    log.add("policy", 6, 0, "p", [sample(1.0, "z")])  # a third version: the oldest goes
    assert log.get("policy", 4) == [] and log.get("policy", 6)[0]["completion"] == "z"
    assert log.get("other", 6) == []


def test_the_route_serves_what_eval_pushes_left(tmp_path):
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2, eval=EVAL))
    with TestClient(app, base_url="http://127.0.0.1") as http:
        flow: Dataflow = app.state.dataflow
        publish(flow, 1)
        flow.register(["policy"], 8, "raas-a", {})
        tasks = [t for t in flow.lease("raas-a", 16) if t.kind == "eval" and t.eval_version == 1]
        assert len(tasks) == 3
        for t in tasks:
            pushed = samples(t, [1.0, 0.0], version=1)
            pushed[0].metadata = {"completion": f"answer {t.task_id}"}
            flow.push("raas-a", t.task_id, pushed)
        r = http.get("/v1/eval/policy/1/completions")
        assert r.status_code == 200, r.text
        rows = r.json()["completions"]
        assert len(rows) == 3 and {row["reward"] for row in rows} == {1.0}
        assert all(row["completion"].startswith("answer eval:policy:v1:") for row in rows)
        assert all(isinstance(row["prompt"], str) and row["prompt"] for row in rows)
        assert len(http.get("/v1/eval/policy/1/completions?limit=2").json()["completions"]) == 2
        assert http.get("/v1/eval/policy/7/completions").json()["completions"] == []
        for bad in ("/v1/eval/policy/1/completions?limit=0",
                    "/v1/eval/policy/1/completions?limit=9",
                    "/v1/eval/policy/-1/completions", "/v1/eval/ghost/1/completions"):
            assert 400 <= http.get(bad).status_code < 500, bad


# ----------------------------------------------------------------------------- the trainer side


ROWS = [{"prompt": "1+2=", "completion": "3", "completion_ids": None, "reward": 1.0,
         "finish_reason": "stop"},
        {"prompt": "a|b\nc", "completion": None, "completion_ids": [7, 8], "reward": 0.0,
         "finish_reason": "length"}]
EVALS = {4: {"complete": True, "avg_at_k": 0.5, "pass_at_k": 0.75},
         5: {"complete": False, "avg_at_k": 0.0, "pass_at_k": 0.0}}


def test_the_monitor_logs_a_table_to_wandb_and_text_to_tensorboard_once():
    wandb, tensorboard, csv = TableLogger(), TextLogger(), RecordingLogger()
    monitor, trainer = monitor_with({"models": {}}, EVALS, loggers=[tensorboard, wandb, csv],
                                    completion_rows={4: ROWS, 5: ROWS})
    monitor._decode = lambda ids: "".join(chr(96 + i) for i in ids)  # the policy's tokenizer
    monitor.poll(trainer)
    monitor.poll(trainer)  # version 4 again: logged once

    assert monitor.client.completion_calls == [("policy", 4, 8)]  # not 5: incomplete
    (table,) = wandb.tables
    assert table["key"] == "eval/completions" and table["step"] == 8  # version 4 * 2 steps
    assert table["columns"] == ["prompt", "completion", "reward", "finish_reason"]
    assert table["data"] == [["1+2=", "3", 1.0, "stop"], ["a|b\nc", "gh", 0.0, "length"]]
    ((tag, text, step),) = tensorboard.experiment.texts
    assert (tag, step) == ("eval/completions", 8)
    lines = text.splitlines()
    assert lines[0] == "| prompt | completion | reward | finish_reason |"
    assert lines[3] == "| a\\|b ⏎ c | gh | 0 | length |"  # one row per completion, escaped
    assert len(lines) == 4


def test_completion_ids_without_a_tokenizer_stay_ids_and_a_row_limit_applies():
    assert table_rows(ROWS[1:])[0][1] == "token ids [7, 8]"
    wandb = TableLogger()
    monitor, trainer = monitor_with({"models": {}}, EVALS, loggers=[wandb],
                                    completion_rows={4: ROWS}, completions=1)
    monitor.poll(trainer)
    assert monitor.client.completion_calls == [("policy", 4, 1)]
    assert len(wandb.tables[0]["data"]) == 1
    assert markdown_table(["a"], [[0.123456]]).splitlines()[2] == "| 0.123 |"


def test_an_older_service_without_the_route_turns_the_table_off(caplog):
    wandb = TableLogger()
    evals = {4: dict(EVALS[4]), 6: dict(EVALS[4])}
    monitor, trainer = monitor_with({"models": {}}, evals, loggers=[wandb], completion_rows=None)
    with caplog.at_level(logging.WARNING):
        monitor.poll(trainer)
    assert "no completions table" in caplog.text
    assert monitor.completions == 0 and wandb.tables == []
    assert len(monitor.client.completion_calls) == 1  # asked once, not for every version
    assert wandb.merged()["eval/avg_at_k"] == 0.5  # the scalars are logged all the same


def test_completions_sent_as_ids_are_decoded_with_the_policy_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    monitor, trainer = monitor_with({"models": {}}, {})
    dm = SimpleNamespace(dataflow_url="http://127.0.0.1:1")
    module = SimpleNamespace(model_id="policy", model_path=str(tiny_model_dir))
    trainer.datamodule, trainer.callbacks = dm, []
    monitor.setup(trainer, module, "fit")
    ids = AutoTokenizer.from_pretrained(str(tiny_model_dir)).encode("12+7=19",
                                                                     add_special_tokens=False)
    assert table_rows([{"completion_ids": ids, "reward": 1.0}], monitor._decode)[0][1] == "12+7=19"
