"""AlfWorldEnv and AlfWorldGames on the tiny hand-written ALFWorld game of tests/fixtures/alfworld
(ALFWorld's domain and grammar, a one-apple problem): the source picks games as ALFWorld does,
the walkthrough wins with ALFWorld's reward, wrong commands are counted, the opening text is
clean with the task first, and bad paths are named. Playing needs TextWorld's PDDL engine and
the alfworld package (skipped without them: see astralight/envs/alfworld_env.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from astralight.envs.alfworld_env import (
    AlfWorldEnv, AlfWorldGames, opening_text, task_description)
from astralight.protocol import Task

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "alfworld" / "train"
GAME = FIXTURE / "pick_and_place_simple-Apple-None-Fridge-1" / "trial_T0"
WALKTHROUGH = ["go to countertop 1", "take apple 1 from countertop 1", "go to fridge 1",
               "open fridge 1", "move apple 1 to fridge 1"]


def _playable():
    pytest.importorskip("fast_downward", reason="needs textworld[pddl] (fast-downward-textworld)")
    pytest.importorskip("alfworld", reason="needs the alfworld package")


def _task(game) -> Task:
    return Task(task_id="a", prompt="", n=1, model_ids=["p"], metadata={"game": str(game)})


def test_the_source_lists_the_fixture_game():
    src = AlfWorldGames(str(FIXTURE))
    assert len(src) == 1
    p = src.get(0)
    assert p.prompt_id == "pick_and_place_simple-Apple-None-Fridge-1/trial_T0"
    assert p.prompt == "put a apple in fridge"
    assert p.metadata == {"game": str(GAME), "task_type": "pick_and_place_simple",
                          "walkthrough": WALKTHROUGH}


def test_the_source_skips_what_alfworld_skips(tmp_path):
    def copy(name, edit=None, traj_edit=None):
        dst = tmp_path / name / "trial_T0"
        shutil.copytree(GAME, dst)
        if edit:
            game = json.loads((dst / "game.tw-pddl").read_text())
            edit(game)
            (dst / "game.tw-pddl").write_text(json.dumps(game))
        if traj_edit:
            traj = json.loads((dst / "traj_data.json").read_text())
            traj_edit(traj)
            (dst / "traj_data.json").write_text(json.dumps(traj))
        return dst

    copy("ok")
    copy("pick_and_place_simple-Apple-None-Fridge-1-movable")
    copy("unsolvable", edit=lambda g: g.update(solvable=False))
    copy("heat", traj_edit=lambda t: t.update(task_type="pick_heat_then_place_in_recep"))
    (copy("nogame") / "game.tw-pddl").unlink()
    src = AlfWorldGames(str(tmp_path), task_types=["pick_and_place_simple"])
    assert [src.get(i).prompt_id for i in range(len(src))] == ["ok/trial_T0"]
    assert src.skipped == {"unsupported": 1, "task_type": 1, "no_game": 1, "unsolvable": 1}
    assert len(AlfWorldGames(str(tmp_path))) == 2  # every task type: heat counts too
    with pytest.raises(ValueError, match="task_types"):
        AlfWorldGames(str(tmp_path), task_types=["juggle"])
    with pytest.raises(ValueError, match="no playable ALFWorld games"):
        AlfWorldGames(str(tmp_path / "nogame"))
    with pytest.raises(FileNotFoundError, match="games_dir"):
        AlfWorldGames(str(tmp_path / "absent"))


def test_bad_game_paths_name_the_field(tmp_path):
    env = AlfWorldEnv()
    with pytest.raises(KeyError, match="'game'"):
        env.reset(Task(task_id="a", prompt="", n=1, model_ids=["p"], metadata={}))
    with pytest.raises(FileNotFoundError, match=r"task.metadata\['game'\]"):
        env.reset(_task(tmp_path))  # a folder without game.tw-pddl
    with pytest.raises(ValueError, match=r"task.metadata\['game'\].*tw-pddl"):
        env.reset(_task(GAME / "traj_data.json"))


def test_text_helpers():
    intro = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. You see a "
             "fridge 1.\n\nYour task is to: put a apple in fridge.")
    assert opening_text(intro, True).splitlines()[0] == "Your task is to: put a apple in fridge."
    assert "Welcome" not in opening_text(intro, False)
    assert task_description('"rhs": "Your task is to: cool some mug."') == "cool some mug"


def test_the_walkthrough_wins_with_alfworlds_reward():
    _playable()
    env = AlfWorldEnv(games_dir=str(FIXTURE))
    first = env.reset(_task(GAME.relative_to(FIXTURE)))  # a folder, relative to games_dir
    assert first.splitlines()[0] == "Your task is to: put a apple in fridge."
    assert "Welcome" not in first and "countertop 1" in first and "fridge 1" in first
    steps = [env.step(c) for c in WALKTHROUGH]
    assert [r for _, r, _ in steps] == [0.0] * 4 + [1.0]
    assert [d for _, _, d in steps] == [False] * 4 + [True]
    assert steps[0][0] == "You arrive at countertop 1. On the countertop 1, you see a apple 1."
    assert env.metrics() == {"won": True, "moves": 5, "invalid_actions": 0}
    env.close()


def test_wrong_commands_earn_nothing_and_are_counted():
    _playable()
    env = AlfWorldEnv(max_obs_chars=30)
    env.reset(_task(GAME / "game.tw-pddl"))
    obs, reward, done = env.step("take apple 1 from countertop 1")  # not there yet
    assert (obs, reward, done) == ("Nothing happens.", 0.0, False)
    obs, reward, done = env.step("go to countertop 1")
    assert len(obs) <= 30 and obs.endswith("...")
    assert env.metrics()["invalid_actions"] == 1 and not env.metrics()["won"]
    env.close()


def test_a_chat_episode_on_the_fixture():
    _playable()
    from astralight.engine import SamplingSpec
    from astralight.trainer.tinymodel import build_chat_tokenizer
    from astralight.workflows.chat_env import ChatEnvWorkflow
    from tests.unit.engine_fakes import ScriptedEngine, run_tasks

    tok = build_chat_tokenizer()
    engine = ScriptedEngine(tok, WALKTHROUGH, max_model_len=2048)
    wf = ChatEnvWorkflow("astralight.envs.alfworld_env.AlfWorldEnv", max_turns=10,
                         sampling=SamplingSpec(max_tokens=40))
    [s] = run_tasks(wf, [_task(GAME)], {"p": engine})["a"]
    assert s.reward == 1.0 and s.metadata["end"] == "done" and s.metadata["env"]["won"]
    assert s.metadata["actions"] == WALKTHROUGH
