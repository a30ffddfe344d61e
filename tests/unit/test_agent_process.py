"""Agents out of process (astralight/workflows/agent_process.py, agent_runner.py): the runner's
JSON-lines protocol driven directly, and the workflow against the real OpenAI endpoint with a
scripted engine (tests/unit/engine_fakes.py), the agents in a worker process or run as a command.

Checked: the runner imports the agent in the child and reports its answers, errors (type, message,
the child's traceback) and printed lines (naming the episode) as JSON lines, never corrupted by
what the agent writes to file descriptor 1, and exits at the end of its stdin even with an agent
thread hung; the workflow gives the same masked samples as in-process, sends no ``metadata``
unless asked, counts child exceptions as agent errors (``fail_fast`` stops the run naming the
child's error), cancels and kills on timeout, restarts a worker that died, and refuses a missing
interpreter or an agent that does not import with the field and the fix.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from astralight.protocol import Task
from astralight.rewards.toy import ExactMatchReward
from astralight.workflows.agent_process import RUNNER, ProcessAgentWorkflow
from astralight.workflows.base import BrokenWorkflowError, TaskFailedError
from astralight.workflows.openai_agent import OpenAIAgentWorkflow
from tests.unit.engine_fakes import PromptScriptEngine, calculator, run_tasks

ROOT = Path(__file__).resolve().parents[2]
AGENTS = Path(__file__).resolve().parent / "process_agents" / "agents.py"
CLI = Path(__file__).resolve().parent / "process_agents" / "cli_agent.py"
EXAMPLE_AGENT = ROOT / "examples" / "openai_agent" / "agent.py"


@pytest.fixture
def engine(tok):
    eng = PromptScriptEngine(calculator, tok, version=3, max_model_len=512, logprob=-0.5)
    yield eng
    eng.close()


def _task(task_id="t0", n=2, kind="train"):
    return Task(task_id=task_id, prompt="123+456=", n=n, model_ids=["policy"], kind=kind,
                metadata={"answer": "579"})


def _agent(name: str) -> str:
    return f"{AGENTS}:{name}"


# ----------------------------------------------------------------------------- the runner


class Runner:
    """The runner script in a child interpreter, driven line by line."""

    def __init__(self, agent: str):
        self.proc = subprocess.Popen([sys.executable, str(RUNNER), agent],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def send(self, **msg):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the runner closed its stdout; stderr: {self.proc.stderr.read()}"
        return json.loads(line)

    def until(self, op: str, episode: str) -> tuple[dict, list[dict]]:
        """Messages up to the one ``op`` of ``episode``: (that one, the others)."""
        others = []
        while True:
            msg = self.read()
            if msg["op"] == op and msg.get("id") == episode:
                return msg, others
            others.append(msg)


def _run(episode: str, **task) -> dict:
    return {"op": "run", "id": episode, "task": {"task_id": "t", "episode": 0, **task},
            "base_url": "http://127.0.0.1:9/v1", "api_key": "k", "model": "policy",
            "kwargs": {}}


def test_runner_protocol_answers_errors_logs_and_exit(tmp_path):
    agent_file = tmp_path / "plain.py"
    agent_file.write_text(
        "import os, sys, time\n"
        "def agent(task, base_url, api_key, model, **kw):\n"
        "    if task.get('hang'):\n"
        "        time.sleep(600)\n"
        "    if task.get('fail'):\n"
        "        raise ValueError('bad arguments ' + model)\n"
        "    print('working on', task['task_id'])\n"
        "    os.write(1, b'not json\\n')\n"
        "    return {'url': base_url, 'key': api_key, 'kw': kw}\n")
    r = Runner(f"{agent_file}:agent")
    ready = r.read()
    assert ready["op"] == "ready" and ready["async"] is False and ready["pid"] == r.proc.pid
    r.send(**{**_run("e1"), "kwargs": {"depth": 2}})
    done, others = r.until("done", "e1")
    # the answer is text (JSON for anything but a string); the print came as the episode's log
    assert json.loads(done["answer"]) == {"url": "http://127.0.0.1:9/v1", "key": "k",
                                          "kw": {"depth": 2}}
    assert {"op": "log", "id": "e1", "text": "working on t"} in others
    r.send(**_run("e2", fail=True))
    err, _ = r.until("error", "e2")
    assert (err["type"], err["message"]) == ("ValueError", "bad arguments policy")
    assert "plain.py" in err["traceback"] and "raise ValueError" in err["traceback"]
    r.send(**_run("e3", hang=True))  # a thread that never ends cannot keep the worker alive
    r.proc.stdin.close()
    assert r.proc.wait(timeout=30) == 0
    # what reached fd 1 went to stderr, not into the protocol
    assert "not json" in r.proc.stderr.read()


def test_runner_cancels_async_agents_and_reports_a_bad_import(tmp_path):
    (tmp_path / "aio.py").write_text(
        "import asyncio\n"
        "async def agent(task, base_url, api_key, model):\n"
        "    print('started', task['task_id'])\n"
        "    try:\n"
        "        await asyncio.sleep(600)\n"
        "    except asyncio.CancelledError:\n"
        "        print('cancelled', task['task_id'])\n"
        "        raise\n")
    r = Runner(f"{tmp_path / 'aio.py'}:agent")
    assert r.read()["async"] is True
    r.send(**_run("e1"))
    started, _ = r.until("log", "e1")
    assert started["text"] == "started t"
    r.send(op="cancel", id="e1")
    log_line, _ = r.until("log", "e1")
    assert log_line["text"] == "cancelled t"
    r.proc.stdin.close()
    assert r.proc.wait(timeout=30) == 0
    bad = Runner("no_such_package.agents:run")
    fatal = bad.read()
    assert fatal["op"] == "fatal" and "ModuleNotFoundError" in fatal["error"]
    assert bad.proc.wait(timeout=30) == 3


def test_runner_uses_only_the_standard_library():
    """It runs in interpreters without astralight: every import is a standard module."""
    src = RUNNER.read_text()
    imported = {line.split()[1].split(".")[0] for line in src.splitlines()
                if line.startswith(("import ", "from "))}
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    out = subprocess.run([sys.executable, "-I", "-S", str(RUNNER), "x.y:z"], input="",
                         capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout.splitlines()[0])["op"] == "fatal"  # ran, could not import x


# ----------------------------------------------------------------------------- the workflow


def test_worker_agent_gives_the_in_process_samples(endpoint, engine, tok):
    inproc = OpenAIAgentWorkflow(_load_example().calculator_agent, ExactMatchReward(),
                                 endpoint=endpoint)
    expected = run_tasks(inproc, [_task(n=2)], {"policy": engine})["t0"]
    wf = ProcessAgentWorkflow(f"{EXAMPLE_AGENT}:calculator_agent", ExactMatchReward(),
                              endpoint=endpoint)
    try:
        samples = run_tasks(wf, [_task(n=2)], {"policy": engine})["t0"]
    finally:
        wf.close()
    assert len(samples) == len(expected) == 2
    for got, want in zip(sorted(samples, key=lambda s: s.group_index),
                         sorted(expected, key=lambda s: s.group_index)):
        assert got.token_ids.tolist() == want.token_ids.tolist()
        assert got.loss_mask.tolist() == want.loss_mask.tolist()  # tool results masked alike
        assert got.versions.tolist() == want.versions.tolist()
        assert np.allclose(got.logprobs, want.logprobs)
        assert got.reward == want.reward == 1.0 and got.metadata["tool_calls"] == 1
        masked = got.token_ids[(got.loss_mask == 0) & (np.arange(got.num_tokens)
                                                       >= got.prompt_len)].tolist()
        assert "<tool_response>\n579\n</tool_response>" in tok.decode(masked)
    assert wf.stats["agent_errors"] == 0 and wf.stats["merged_calls"] == 2


def _load_example():
    spec = importlib.util.spec_from_file_location("openai_agent_example", EXAMPLE_AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_child_gets_no_metadata_unless_asked_and_its_prints_name_the_episode(
        endpoint, engine, caplog):
    wf = ProcessAgentWorkflow(_agent("keys_agent"), ExactMatchReward(), endpoint=endpoint)
    opted = ProcessAgentWorkflow(_agent("keys_agent"), ExactMatchReward(), endpoint=endpoint,
                                 send_metadata=True)
    try:
        with caplog.at_level(logging.INFO, logger="astralight.workflows.agent_process"):
            [s] = run_tasks(wf, [_task(n=1)], {"policy": engine})["t0"]
            [m] = run_tasks(opted, [_task(n=1)], {"policy": engine})["t0"]
    finally:
        wf.close()
        opted.close()
    assert json.loads(s.metadata["answer"]) == {
        "keys": ["episode", "kind", "messages", "prompt", "task_id"], "model": "policy"}
    assert "metadata" in json.loads(m.metadata["answer"])["keys"]
    assert s.reward == 0.0 and s.loss_mask.any()  # scored here, on the answer
    text = caplog.text
    assert "agent t0-0.0: hello from t0 episode 0" in text and "agent t0-0.0: to stderr" in text


def test_child_exceptions_are_agent_errors_with_their_traceback(endpoint, engine, caplog):
    wf = ProcessAgentWorkflow(_agent("broken_agent"), ExactMatchReward(), endpoint=endpoint,
                              fail_fast=3)
    try:
        with caplog.at_level(logging.WARNING):
            samples = run_tasks(wf, [_task(n=2)], {"policy": engine})["t0"]
        # scored failed_reward on the call it made, its own error type and message recorded
        assert len(samples) == 2 and all(s.reward == 0.0 for s in samples)
        assert samples[0].metadata["agent_error"] == "KeyError: 'no_such_tool'"
        assert wf.stats["agent_errors"] == 2
        assert "agents.py" in caplog.text and "raise KeyError" in caplog.text  # the child's
        with pytest.raises(BrokenWorkflowError, match=r"first 3 episodes.*KeyError: "
                                                      r"'no_such_tool'"):
            run_tasks(wf, [_task(n=2)], {"policy": engine})
    finally:
        wf.close()


def test_timeouts_cancel_async_agents_and_kill_commands(endpoint, engine, tmp_path, caplog):
    aio = ProcessAgentWorkflow(_agent("async_sleepy_agent"), ExactMatchReward(),
                               endpoint=endpoint, timeout_s=3.0, startup_timeout_s=60)
    try:
        with caplog.at_level(logging.INFO, logger="astralight.workflows.agent_process"):
            with pytest.raises(TaskFailedError, match="first: timeout"):
                run_tasks(aio, [_task(n=1)], {"policy": engine})
            assert aio.stats["agent_timeouts"] == 1
            deadline = time.monotonic() + 30
            while "cancelled 0" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "agent t0-0.0: cancelled 0" in caplog.text  # its task got the cancellation
    finally:
        aio.close()
    pid_file = tmp_path / "pid"
    cmd = ProcessAgentWorkflow(command=[sys.executable, str(CLI), "hang", str(pid_file)],
                               reward=ExactMatchReward(), endpoint=endpoint, timeout_s=10.0)
    with pytest.raises(TaskFailedError, match="first: timeout"):
        run_tasks(cmd, [_task(n=1)], {"policy": engine})
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the timed-out command is still running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_sync_agent_stuck_past_its_timeout_gets_the_worker_replaced(endpoint, engine):
    wf = ProcessAgentWorkflow(_agent("sleepy_agent"), ExactMatchReward(), endpoint=endpoint,
                              timeout_s=0.5, max_stuck_agents=2, agent_kwargs={"seconds": 600})
    try:
        with pytest.raises(TaskFailedError):
            run_tasks(wf, [_task(n=2)], {"policy": engine})
        first = wf._worker
        assert first.stuck == 2
        with pytest.raises(TaskFailedError):
            run_tasks(wf, [_task(n=1)], {"policy": engine})
        assert wf._worker is not first and first.retired
        assert first.proc.wait(timeout=30) is not None  # the old one was ended
    finally:
        wf.close()


def test_a_worker_that_dies_fails_its_episodes_and_is_restarted(endpoint, engine, caplog):
    wf = ProcessAgentWorkflow(_agent("dying_agent"), ExactMatchReward(), endpoint=endpoint,
                              max_worker_restarts=1)
    try:
        with caplog.at_level(logging.WARNING):
            with pytest.raises(TaskFailedError, match=r"AgentWorkerDied: the agent worker "
                                                      r"\(pid \d+, .*\) exited with code 7"):
                run_tasks(wf, [_task("die0", n=1)], {"policy": engine})
            # the next task gets a new worker, which answers
            [s] = run_tasks(wf, [_task("t1", n=1)], {"policy": engine})["t1"]
            assert s.metadata["end"] == "answer" and s.metadata["answer"].startswith("Let me")
            assert wf.stats["worker_restarts"] == 1 and "starting another" in caplog.text
            with pytest.raises(TaskFailedError, match="AgentWorkerDied"):
                run_tasks(wf, [_task("die1", n=1)], {"policy": engine})
        with pytest.raises(BrokenWorkflowError, match="died 2 times.*max_worker_restarts"):
            run_tasks(wf, [_task("t2", n=1)], {"policy": engine})
    finally:
        wf.close()


def test_command_agent_gets_the_episode_in_its_environment(endpoint, engine, caplog):
    wf = ProcessAgentWorkflow(command=[sys.executable, str(CLI)], reward=ExactMatchReward(),
                              endpoint=endpoint)
    with caplog.at_level(logging.INFO, logger="astralight.workflows.agent_process"):
        [s] = run_tasks(wf, [_task(n=1)], {"policy": engine})["t0"]
    # no tools declared: the model's tool-call text is the answer (printed on stdout)
    assert s.metadata["answer"].startswith("Let me add.") and s.loss_mask.any()
    assert "agent t0-0: episode t0-0" in caplog.text  # its stderr, naming the episode
    assert 'agent t0-0: ["episode", "kind", "messages", "prompt", "task_id"]' in caplog.text
    failing = ProcessAgentWorkflow(command=f"{sys.executable} {CLI} fail",
                                   reward=ExactMatchReward(), endpoint=endpoint)
    [f] = run_tasks(failing, [_task(n=1)], {"policy": engine})["t0"]
    assert f.metadata["end"] == "error" and f.reward == 0.0
    assert f.metadata["agent_error"].startswith("CommandFailed: ") and "exited with code 4" in \
        f.metadata["agent_error"]


def test_config_errors_name_the_field_and_the_fix(endpoint, engine, tmp_path):
    with pytest.raises(ValueError, match=r"python: '/no/such/venv/bin/python' is not an "
                                         r"executable Python interpreter.*python -m venv"):
        ProcessAgentWorkflow("pkg.mod:agent", ExactMatchReward(), python="/no/such/venv/bin/python")
    with pytest.raises(ValueError, match="agent / command: give exactly one"):
        ProcessAgentWorkflow(reward=ExactMatchReward())
    with pytest.raises(ValueError, match="agent: out of process, name the function"):
        ProcessAgentWorkflow(lambda *a, **k: "x", ExactMatchReward())
    with pytest.raises(ValueError, match="agent_kwargs: must be JSON"):
        ProcessAgentWorkflow("pkg.mod:agent", ExactMatchReward(), agent_kwargs={"x": object()})
    with pytest.raises(ValueError, match="python: only for agent"):
        ProcessAgentWorkflow(command=["true"], python=sys.executable, reward=ExactMatchReward())
    missing = ProcessAgentWorkflow("no_such_package.agents:run", ExactMatchReward(),
                                   endpoint=endpoint)
    with pytest.raises(BrokenWorkflowError, match=r"agent: 'no_such_package.agents:run' in .* "
                                                  r"does not load: ModuleNotFoundError.*pip "
                                                  r"install.*pythonpath"):
        run_tasks(missing, [_task(n=1)], {"policy": engine})
    not_fn = ProcessAgentWorkflow(_agent("NOT_A_FUNCTION"), ExactMatchReward(), endpoint=endpoint)
    with pytest.raises(BrokenWorkflowError, match="is a int, not a function"):
        run_tasks(not_fn, [_task(n=1)], {"policy": engine})
