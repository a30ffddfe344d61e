"""Text-game episodes end to end on real components: TextWorld games generated here, the tiny chat
model warm-started on their walkthroughs (laid out as ChatEnvWorkflow lays out episodes), a real
vLLM engine on CPU, and ChatEnvWorkflow playing the games through TextWorldEnv.

Checked: the model's actions reach the games (episodes win, the games' own answers come back as
the next user turns), observation tokens are masked (loss mask 0, version -1, log-prob 0) while
action tokens carry the engine's version, rewards arrive, and after an in-place weight update
new episodes carry the new version."""

from __future__ import annotations

import time

import numpy as np
import pytest

from astralight.engine import SamplingSpec
from astralight.protocol import Task
from tests.unit.engine_fakes import run_tasks

pytestmark = pytest.mark.vllm

#: short observations: every character is a token of the 512-position tiny model
ENV_KWARGS = {"max_obs_chars": 80, "max_intro_chars": 200}
SYSTEM_PROMPT = ""  # the warm start and the workflow must agree; none keeps sequences short


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """Four one-room games: two one-command quests, two two-command quests."""
    from astralight.envs.textworld_env import make_games

    out = tmp_path_factory.mktemp("tw_games")
    start = time.monotonic()
    made = (make_games(out, 2, seed=0, nb_rooms=1, quest_length=1)
            + make_games(out, 2, seed=20, nb_rooms=1, quest_length=2, only_last_action=False))
    print(f"\n4 TextWorld games generated in {time.monotonic() - start:.1f}s")
    return made


@pytest.fixture(scope="module")
def engine(games, tmp_path_factory):
    from astralight.envs.textworld_warmstart import build_textworld_policy
    from astralight.raas.vllm_engine import VLLMEngine

    start = time.monotonic()
    # one thread: on a busy two-core machine two torch threads made each step ~20x slower
    policy = build_textworld_policy(tmp_path_factory.mktemp("tw_policy") / "model", games,
                                    system_prompt=SYSTEM_PROMPT, env_kwargs=ENV_KWARGS,
                                    sft_steps=80, batch_size=8, num_threads=1)
    print(f"warm start (80 steps of 8 walkthroughs) {time.monotonic() - start:.1f}s")
    eng = VLLMEngine(str(policy), dtype="bfloat16", max_model_len=512, seed=0,
                     kv_cache_memory_bytes=64 << 20, enforce_eager=True, warmup=True)
    print(f"vLLM engine start {eng.start_s:.1f}s, warm-up {eng.warmup_s:.1f}s")
    eng.policy_dir = policy
    yield eng
    eng.close()


def _workflow():
    from astralight.workflows.chat_env import ChatEnvWorkflow

    return ChatEnvWorkflow("astralight.envs.textworld_env.TextWorldEnv",
                           environment_kwargs=ENV_KWARGS, system_prompt=SYSTEM_PROMPT,
                           max_turns=4, max_total_tokens=512,
                           sampling=SamplingSpec(temperature=1.0, max_tokens=32, seed=0))


def _tasks(games, n: int, prefix: str = "g") -> list[Task]:
    from astralight.envs.textworld_tasks import TextWorldGames

    src = TextWorldGames(str(games[0].parent), split="all")
    return [Task(task_id=f"{prefix}{i}", prompt=p.prompt, n=n, model_ids=["policy"],
                 workflow="chat_env", metadata=p.metadata)
            for i, p in enumerate(src.get(j) for j in range(len(src)))]


def _check_layout(s, version: int) -> None:
    mask, versions = np.asarray(s.loss_mask), np.asarray(s.versions)
    assert not mask[: s.prompt_len].any() and mask[-1] == 1
    assert (versions[mask == 0] == -1).all() and (np.asarray(s.logprobs)[mask == 0] == 0).all()
    assert (versions[mask == 1] == version).all()
    assert (np.asarray(s.logprobs)[mask == 1] <= 0).all()


def test_episodes_act_on_the_games_and_win(engine, games):
    tasks = _tasks(games, n=4)
    out = run_tasks(_workflow(), tasks, {"policy": engine})
    samples = [s for t in tasks for s in out[t.task_id]]
    assert len(samples) == 16
    tok = engine.tokenizer
    wins, observed = 0, 0
    for s in samples:
        _check_layout(s, engine.version)
        actions = s.metadata["actions"]
        assert actions and s.metadata["turns"] == len(actions)  # no tools: every turn acts
        trained = tok.decode([t for t, m in zip(s.token_ids, s.loss_mask) if m],
                             skip_special_tokens=True)
        assert all(a in trained for a in actions)
        env = s.metadata["env"]
        assert env["max_score"] >= 1
        assert s.reward == pytest.approx(env["score"])  # the sum of the steps' score changes
        wins += bool(env["won"])
        assert (s.metadata["end"] == "done") == (env["won"] or env["lost"])
        if len(actions) > 1:  # the game's answer to the first action came back as a user turn
            after_prompt = [t for t, m in zip(s.token_ids[s.prompt_len:],
                                              s.loss_mask[s.prompt_len:]) if not m]
            assert "<|im_start|>user\n" in tok.decode(after_prompt)
            observed += 1
    print(f"\ntextworld on vLLM: {wins}/{len(samples)} episodes won, {observed} with an "
          f"observation turn")
    assert wins >= 1
    assert sum(s.reward for s in samples) >= 1.0
    # the two-command games need a second action, so their wins went through an observation
    two_step = [s for t in tasks[2:] for s in out[t.task_id] if s.metadata["env"]["won"]]
    assert all(len(s.metadata["actions"]) >= 2 for s in two_step)


def test_new_episodes_carry_the_version_of_an_in_place_weight_update(engine, games):
    from safetensors.torch import load_file

    weights = load_file(str(engine.policy_dir / "model.safetensors"))
    before = int(engine.version)
    engine.update_weights(weights, version=before + 1)  # same weights: only the version moves
    try:
        assert engine.version == before + 1
        task = _tasks(games, n=2, prefix="after")[0]
        samples = run_tasks(_workflow(), [task], {"policy": engine})[task.task_id]
        assert len(samples) == 2
        for s in samples:
            _check_layout(s, before + 1)
    finally:
        engine.update_weights(weights, version=before)
