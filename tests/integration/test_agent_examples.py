"""The framework agents of examples/agents/ trained briefly, as a user runs them: ``astralight run``
on each shipped recipe with fewer versions, real vLLM on CPU.

- ``openai_agents_sdk``: the OpenAI Agents SDK on its default provider (the Responses API, the
  SDK's per-process HTTP client);
- ``mcp_tools``: the same SDK with its ``add`` tool behind an MCP server (stdio);
- ``anthropic_client``: the ``anthropic`` client on the Messages API.

(The LangGraph team is tests/integration/test_agent_team_example.py.) All three share the
calculator toy's warm start, built once for the session (tests/integration/example_runs.py).

And a broken agent (one that raises the same error in every episode) stops ``astralight run``
with the agent's error on the terminal, and nothing is restarted.

Checked for each: the run ends on its versions with at most 2% of its episodes failed (a
policy's failure, scored 0, e.g. arguments its tool cannot read; none timed out); held-out accuracy (100
sums, avg@2: a quarter of the example's own eval, for CI's time) rises by 10 points from the
version-0 evaluation to the last; the stored samples of episodes that called
``add`` carry its result as masked tokens after trained completions, never as trained tokens,
and each stored sample's conversation is its own task's. Slow (a warm start, then a run each).
"""

from __future__ import annotations

import json
import re
import time

import yaml

import pytest

from tests.integration.example_runs import (ROOT, launch, masked_tool_results, run_example,
                                            short_recipe, stored_samples)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

VERSIONS = 10
RISE = 0.10


@pytest.mark.parametrize("example", ["openai_agents_sdk", "mcp_tools", "anthropic_client"])
def test_a_framework_agent_learns_through_the_endpoint(example, tmp_path):
    run_dir = tmp_path / "run"
    summary = run_example(short_recipe(ROOT / "examples" / "agents" / example, tmp_path,
                                       VERSIONS, eval_size=100, eval_k=2), run_dir)
    assert summary["stop_reason"] == "versions" and summary["versions"] == VERSIONS, summary
    start, end = summary["eval_accuracy_start"], summary["eval_accuracy_end"]
    print(json.dumps({"example": example, "eval_start": start, "eval_end": end,
                      "tool_call_rate": [summary.get("tool_call_rate_start"),
                                         summary.get("tool_call_rate_end")],
                      "agents_failed": summary.get("agents_failed")}))
    # a failed episode is the policy's (e.g. arguments the tool cannot read), scored 0; a
    # systematic failure (the framework not working through the endpoint) would be most of them
    failed, episodes = summary["agents_failed"], summary["counters"]["agent_episodes"]
    assert failed["timeout"] == 0 and failed["error"] <= 0.02 * episodes, (failed, episodes)
    assert end - start >= RISE, f"{example}: held-out accuracy {start} -> {end}"

    tok, stored = stored_samples(run_dir, VERSIONS, 64)  # each its own task's conversation
    masked = masked_tool_results(tok, stored)  # tool results masked, none trained
    # tool results that reached the model as the plain number (not a JSON dump)
    numbers = sum(bool(re.search(r"<tool_response>\n-?\d+\n</tool_response>", m))
                  for m in masked)
    assert numbers, "no tool result reached the model as a number"


BROKEN_AGENT = '''
def broken_agent(task, base_url, api_key, model, **kwargs):
    raise RuntimeError("the agent's tool registry is empty (a deployment bug)")
'''


def test_a_broken_agent_stops_the_run_with_its_error_on_the_terminal(tmp_path):
    folder = tmp_path / "agent"
    folder.mkdir()
    (folder / "broken.py").write_text(BROKEN_AGENT)
    path = short_recipe(ROOT / "examples" / "openai_agent", tmp_path, VERSIONS, eval_size=100,
                        eval_k=2)
    recipe = yaml.safe_load(path.read_text())
    recipe["pythonpath"] = [str(folder)]
    recipe["raas"][0]["workflow"]["init_args"]["agent"] = "broken.broken_agent"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    start = time.monotonic()
    proc = launch(path, tmp_path / "run", timeout_s=900)
    print(json.dumps({"broken_agent_run_s": round(time.monotonic() - start, 1)}))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "the agent's tool registry is empty (a deployment bug)" in out, out[-3000:]
    assert "fail_fast" in out and "restarted raas" not in out, out[-3000:]
