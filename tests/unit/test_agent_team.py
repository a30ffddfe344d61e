"""Agent teams on several policies (issue 39 item 4): one episode of
:class:`~astralight.workflows.openai_agent.OpenAIAgentWorkflow` calls several models by ``model``
name through the real endpoint and the real ``openai`` client, against scripted engines
(tests/unit/engine_fakes.py).

Checked: each call is served by the engine it names and recorded under that model id; each
trained policy's samples hold exactly its own engine's tokens, log-probs and versions; a frozen
member is served and never trained; rewards shared or per member; eval tasks of one member;
the refusals and the configuration errors name the field and the fix.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import yaml

from astralight.launch.check import check_recipe
from astralight.launch.recipe import RecipeError
from astralight.protocol import Task
from astralight.rewards.toy import ExactMatchReward
from astralight.workflows.openai_agent import OpenAIAgentWorkflow
from tests.unit.engine_fakes import PromptScriptEngine, run_tasks

ROOT = Path(__file__).resolve().parents[2]
TEAM = ["supervisor", "worker", "judge"]


@pytest.fixture
def engines(tok):
    """Three engines that say who they are; each at its own version and log-prob."""
    out = {
        "supervisor": PromptScriptEngine(lambda p, k: "579", tok, version=3, logprob=-0.3),
        "worker": PromptScriptEngine(lambda p, k: "sum 579", tok, version=5, logprob=-0.5),
        "judge": PromptScriptEngine(lambda p, k: "ok", tok, version=0, logprob=-0.7),
    }
    yield out
    for e in out.values():
        e.close()


def supervisor_agent(task, base_url, api_key, model, worker="worker", judge="judge",
                     rewards=None):
    """A supervisor that asks its worker, has a frozen judge look, then answers itself."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    served = sorted(m.id for m in client.models.list().data)
    work = client.chat.completions.create(model=worker, messages=[
        {"role": "user", "content": "work " + task["prompt"]}], max_tokens=8)
    client.chat.completions.create(model=judge, messages=[
        {"role": "user", "content": "judge " + work.choices[0].message.content}], max_tokens=8)
    final = client.chat.completions.create(model=model, messages=[
        {"role": "user", "content": task["prompt"]},
        {"role": "user", "content": "worker says " + work.choices[0].message.content}],
        max_tokens=8)
    answer = final.choices[0].message.content
    assert served == sorted(TEAM), served
    return answer if rewards is None else {"answer": answer, "rewards": rewards}


def _task(task_id="t0", n=2, kind="train", model_ids=("supervisor", "worker")):
    return Task(task_id=task_id, prompt="123+456=", n=n, model_ids=list(model_ids), kind=kind,
                metadata={"answer": "579"})


def test_each_member_trains_on_exactly_its_own_calls_and_a_frozen_one_on_none(endpoint,
                                                                              engines, tok):
    wf = OpenAIAgentWorkflow(supervisor_agent, ExactMatchReward(), endpoint=endpoint, team=TEAM)
    samples = run_tasks(wf, [_task(n=3)], engines)["t0"]
    assert wf.stats["agent_errors"] == 0, wf.stats
    by_model = {m: [s for s in samples if s.model_id == m] for m in ("supervisor", "worker")}
    assert {s.model_id for s in samples} == {"supervisor", "worker"}  # the judge: never trained
    assert len(engines["judge"].requests) == 3  # ... though served, once per episode
    expected = {"supervisor": ("579", 3, -0.3), "worker": ("sum 579", 5, -0.5)}
    for model, ss in by_model.items():
        text, version, logprob = expected[model]
        assert sorted(s.group_index for s in ss) == [0, 1, 2]  # one sample per episode each
        for s in ss:
            trained = s.token_ids[s.loss_mask == 1].tolist()
            assert tok.decode(trained, skip_special_tokens=True) == text
            assert np.all(s.versions[s.loss_mask == 1] == version)
            assert np.allclose(s.logprobs[s.loss_mask == 1], logprob)
            assert s.reward == 1.0  # the team's answer, shared
            assert s.metadata["team_calls"] == {"supervisor": 1, "worker": 1, "judge": 1}
            assert s.metadata["turns"] == 1
    # the worker's prompt is its own conversation, not the supervisor's
    assert all("work 123+456=" in tok.decode(s.token_ids[:s.prompt_len].tolist())
               for s in by_model["worker"])
    assert len({s.sample_index for s in samples}) == len(samples) == 6


def test_a_member_may_get_its_own_reward_from_the_agent(endpoint, engines):
    wf = OpenAIAgentWorkflow(supervisor_agent, ExactMatchReward(), endpoint=endpoint, team=TEAM,
                             agent_rewards=True, agent_kwargs={"rewards": {"worker": 0.25}})
    samples = run_tasks(wf, [_task(n=2)], engines)["t0"]
    assert sorted((s.model_id, s.reward) for s in samples) == [
        ("supervisor", 1.0), ("supervisor", 1.0), ("worker", 0.25), ("worker", 0.25)]
    # a reward for a model the episode does not serve is the agent's error, scored as one
    bad = OpenAIAgentWorkflow(supervisor_agent, ExactMatchReward(), endpoint=endpoint,
                              team=TEAM, agent_rewards=True, fail_fast=0,
                              agent_kwargs={"rewards": {"wroker": 1.0}})
    out = run_tasks(bad, [_task(n=2)], engines)["t0"]
    assert bad.stats["agent_errors"] == 2
    assert {s.reward for s in out} == {0.0}
    assert "rewards names 'wroker'" in out[0].metadata["agent_error"]


def test_an_eval_task_of_one_member_gives_that_members_samples_only(endpoint, engines):
    wf = OpenAIAgentWorkflow(supervisor_agent, ExactMatchReward(), endpoint=endpoint, team=TEAM)
    samples = run_tasks(wf, [_task(n=4, kind="eval", model_ids=["worker"])], engines)["t0"]
    assert [s.model_id for s in samples] == ["worker"] * 4
    assert sorted(s.group_index for s in samples) == [0, 1, 2, 3]
    assert len(engines["supervisor"].requests) == 4  # the lead still led every episode


def test_a_model_outside_the_team_is_a_404_naming_the_members(endpoint, engines):
    heard = []

    def stray(task, base_url, api_key, model):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            client.chat.completions.create(model="critic", messages=[
                {"role": "user", "content": "x"}], max_tokens=4)
        except openai.NotFoundError as exc:
            heard.append(str(exc))
        return ""

    wf = OpenAIAgentWorkflow(stray, ExactMatchReward(), endpoint=endpoint,
                             team=["supervisor", "worker"])
    played = run_tasks(wf, [_task(n=1)], engines)
    assert played == {"t0": []}  # no call reached an engine: no sample
    assert wf.stats["no_calls"] == 1
    assert len(heard) == 1 and "model: 'critic' is not served to this episode; use " \
        "'supervisor' (the model argument the agent was given); its team serves 'supervisor', " \
        "'worker'" in heard[0], heard


def test_team_configuration_errors_name_the_field(endpoint, engines):
    for bad in ("supervisor", [], ["a", "a"], ["a", ""]):
        with pytest.raises(ValueError, match="team: a list of distinct model ids"):
            OpenAIAgentWorkflow(supervisor_agent, ExactMatchReward(), team=bad)
    missing = OpenAIAgentWorkflow(supervisor_agent, ExactMatchReward(), endpoint=endpoint,
                                  team=["supervisor", "critic"])
    with pytest.raises(KeyError, match=r"team: no engine for \['critic'\]"):
        run_tasks(missing, [_task(model_ids=["supervisor"])], engines)
    partial = OpenAIAgentWorkflow(supervisor_agent, ExactMatchReward(), endpoint=endpoint,
                                  team=["supervisor", "judge"])
    with pytest.raises(KeyError, match=r"team: task t0 trains \['worker'\], which the team"):
        run_tasks(partial, [_task()], engines)


def test_a_recipe_serving_an_engine_the_dataflow_does_not_train_must_say_so(tmp_path):
    """A frozen engine is one the RaaS does not register: its model_ids must leave it out."""
    toy = yaml.safe_load((ROOT / "examples" / "toy" / "recipe.yaml").read_text())
    engine = dict(toy["raas"][0]["engines"]["policy"])
    toy["raas"][0]["engines"]["judge"] = engine
    path = tmp_path / "frozen.yaml"
    path.write_text(yaml.safe_dump(toy))
    with pytest.raises(RecipeError, match=r"recipe\.raas\[0\]\.model_ids: \['judge'\] are not "
                                          r"in recipe\.dataflow\.model_ids .* set "
                                          r"recipe\.raas\[0\]\.model_ids: \['policy'\]"):
        check_recipe(path, components=False)
    toy["raas"][0]["model_ids"] = ["policy"]
    path.write_text(yaml.safe_dump(toy))
    check_recipe(path, components=False)


def test_a_raas_builds_its_frozen_engines_and_neither_syncs_nor_registers_them(monkeypatch, tok):
    """An engine left out of the RaaS's model_ids is built and served at its own weights: no
    weight sync follows it and the dataflow never hears of it."""
    import io

    from astralight.engine import SamplingSpec
    from astralight.raas import service as service_module
    from astralight.raas.config import RaaSConfig
    from astralight.raas.service import RaaSService
    from astralight.workflows.single_turn import SingleTurnWorkflow
    from tests.fakes import FakeDataflow

    built = []

    def build(mid, spec, seed):
        built.append((mid, seed))
        return PromptScriptEngine(lambda p, k: "x", tok, version=0)

    monkeypatch.setattr(service_module, "build_engine", build)
    flow = FakeDataflow([])
    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(max_tokens=4))
    cfg = RaaSConfig(dataflow="mem://", workflow=wf, model_ids=["worker", "supervisor"],
                     engines={m: {"model_path": "unused"} for m in TEAM}, max_cycles=0,
                     weight_check_interval_s=3600.0, progress_interval_s=1e9)
    svc = RaaSService(cfg, client_factory=lambda: flow, out=io.StringIO())
    svc.start()
    try:
        assert built == [("worker", 0), ("supervisor", 1), ("judge", 2)]  # policies' seeds kept
        assert sorted(svc.engines) == sorted(TEAM) and sorted(svc.syncs) == ["supervisor", "worker"]
        assert flow.register_metas[-1]["versions"] == {"worker": 0, "supervisor": 0}
    finally:
        svc.close()
        for e in svc.engines.values():
            e.close()
