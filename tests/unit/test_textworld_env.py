"""TextWorldEnv on games TextWorld's own generator makes in a temporary folder: the walkthrough
wins, a wrong command earns nothing and is counted, observations are short and clean, reward
modes, the prompt source's split, bad paths named, and a ChatEnvWorkflow episode on a game."""

from __future__ import annotations

import pytest

from astralight.envs.text import cap, clean_observation, first_line
from astralight.envs.textworld_env import TextWorldEnv, game_record, make_games
from astralight.envs.textworld_tasks import TextWorldGames
from astralight.protocol import Task

pytest.importorskip("textworld")


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """Two games: one room and a one-command quest; two rooms and a two-command quest."""
    out = tmp_path_factory.mktemp("tw_games")
    one = make_games(out, 1, seed=0, nb_rooms=1, quest_length=1)
    two = make_games(out, 1, seed=1, nb_rooms=2, quest_length=2, only_last_action=False)
    return out, one[0], two[0]


def _task(path, **meta) -> Task:
    return Task(task_id="g", prompt="", n=1, model_ids=["p"], metadata={"game": str(path), **meta})


def _play(env, path, commands):
    first = env.reset(_task(path))
    steps = [env.step(c) for c in commands]
    return first, steps


def test_games_are_generated_with_their_json_and_kept(games):
    out, one, two = games
    assert one.suffix == ".z8" and one.with_suffix(".json").is_file() and two.is_file()
    assert one.name == "tw-basic-r1-o3-q1-s0.z8"
    mtime = one.stat().st_mtime_ns
    assert make_games(out, 1, seed=0) == [one] and one.stat().st_mtime_ns == mtime
    assert game_record(one)["walkthrough"] and len(game_record(two)["walkthrough"]) >= 2


@pytest.mark.parametrize("which", [1, 2])
def test_the_walkthrough_wins(games, which):
    path = games[which]
    walkthrough = game_record(path)["walkthrough"]
    env = TextWorldEnv()
    _, steps = _play(env, path, walkthrough)
    rewards = [r for _, r, _ in steps]
    assert [d for _, _, d in steps] == [False] * (len(steps) - 1) + [True]
    assert sum(rewards) == env.metrics()["max_score"] >= 1
    assert env.metrics()["won"] and env.metrics()["invalid_actions"] == 0
    env.close()


def test_a_wrong_command_earns_nothing_and_is_counted(games):
    env = TextWorldEnv()
    _, [(obs, reward, done), (obs2, reward2, done2)] = _play(env, games[1], ["dance wildly",
                                                                         "eat the moon"])
    assert reward == 0.0 and not done and reward2 == 0.0 and not done2
    assert obs  # the game says it did not understand
    assert env.metrics()["invalid_actions"] == 2 and not env.metrics()["won"]
    env.close()


def test_observations_are_clean_and_capped(games):
    env = TextWorldEnv(max_intro_chars=400, max_obs_chars=40)
    first, [(obs, _, _)] = _play(env, games[2], ["look"])
    objective = game_record(games[2])["objective"]
    assert first.startswith(objective[:30])  # the banner is gone: the text starts with the task
    for text in (first, obs):
        assert "$$" not in text and "___" not in text and "\n\n" not in text
        assert not any(line.startswith(">") for line in text.splitlines())
        assert all(" " <= c <= "~" or c == "\n" for c in text)
    assert "0/" not in first.splitlines()[-1]  # no status line (room name, score/moves)
    assert len(first) <= 400 and len(obs) <= 40
    env.close()


def test_reward_modes(games):
    path = games[2]
    walkthrough = game_record(path)["walkthrough"]
    for mode, total in (("normalized", 1.0), ("win", 1.0)):
        env = TextWorldEnv(reward=mode)
        _, steps = _play(env, path, walkthrough)
        assert sum(r for _, r, _ in steps) == pytest.approx(total)
        if mode == "win":
            assert [r for _, r, _ in steps][:-1] == [0.0] * (len(steps) - 1)
        env.close()
    with pytest.raises(ValueError, match="reward"):
        TextWorldEnv(reward="points")


def test_bad_game_paths_name_the_field(games, tmp_path):
    env = TextWorldEnv()
    with pytest.raises(KeyError, match="'game'"):
        env.reset(Task(task_id="x", prompt="", n=1, model_ids=["p"], metadata={}))
    with pytest.raises(FileNotFoundError, match=r"task.metadata\['game'\]"):
        env.reset(_task(tmp_path / "missing.z8"))
    with pytest.raises(ValueError, match=r"task.metadata\['game'\].*\.z8"):
        env.reset(_task(games[1].with_suffix(".json")))
    lonely = tmp_path / "lonely.z8"
    lonely.write_bytes(games[1].read_bytes())
    with pytest.raises(FileNotFoundError, match="lonely.json"):
        env.reset(_task(lonely))


def test_relative_paths_resolve_under_games_dir(games):
    out, one, _ = games
    env = TextWorldEnv(games_dir=str(out))
    assert env.reset(_task(one.name))
    env.close()


def test_prompt_source_lists_and_splits_the_games(games):
    out, one, two = games
    every = TextWorldGames(str(out), split="all")
    assert len(every) == 2 and [every.get(i).prompt_id for i in range(2)] == [one.stem, two.stem]
    p = every.get(0)
    assert p.metadata["game"] == str(one) and p.prompt == game_record(one)["objective"]
    assert p.metadata["walkthrough"] == game_record(one)["walkthrough"]
    env = TextWorldEnv()
    assert env.reset(_task(p.metadata["game"]))
    env.close()
    share = 0.5
    split = {}
    for name in ("train", "eval"):
        try:
            split[name] = {TextWorldGames(str(out), name, share).get(i).prompt_id
                           for i in range(len(TextWorldGames(str(out), name, share)))}
        except ValueError as exc:  # one split may be empty with two games
            assert "no " + name in str(exc)
            split[name] = set()
    assert split["train"] | split["eval"] == {one.stem, two.stem}
    assert not split["train"] & split["eval"]
    rel = TextWorldGames(str(out), split="all", relative_paths=True).get(0)
    assert rel.metadata["game"] == one.name
    with pytest.raises(FileNotFoundError, match="games_dir"):
        TextWorldGames(str(out / "nope"))


def test_a_chat_episode_on_a_game(games):
    from astralight.engine import SamplingSpec
    from astralight.trainer.tinymodel import build_chat_tokenizer
    from astralight.workflows.chat_env import ChatEnvWorkflow
    from tests.unit.engine_fakes import ScriptedEngine, run_tasks

    path = games[2]
    walkthrough = game_record(path)["walkthrough"]
    tok = build_chat_tokenizer()
    engine = ScriptedEngine(tok, ["dance"] + walkthrough, max_model_len=1024)
    wf = ChatEnvWorkflow("astralight.envs.textworld_env.TextWorldEnv",
                         environment_kwargs={"max_obs_chars": 120}, max_turns=8,
                         sampling=SamplingSpec(max_tokens=40))
    [s] = run_tasks(wf, [_task(path)], {"p": engine})["g"]
    assert s.metadata["actions"] == ["dance"] + walkthrough
    assert s.metadata["end"] == "done" and s.reward == pytest.approx(s.metadata["env"]["max_score"])
    assert s.metadata["env"]["won"] and s.metadata["env"]["invalid_actions"] == 1


def test_text_helpers():
    banner = "  ___  \n |$$|  \n\nThe objective is X.\n\n-= Room0 =-\n>   -= Room0 =-0/1"
    assert clean_observation(banner, 100) == "The objective is X.\n-= Room0 =-"
    assert clean_observation("*** The End ***\nYou scored 1 out of a possible 1, in 2 turns.\n"
                             "You win.", 100) == "You win."
    assert cap("abcdefghij", 8) == "abcde..." and cap("abc", 8) == "abc"
    assert clean_observation("caf\u00e9 \u201cok\u201d", 50) == 'cafe "ok"'
    assert first_line("\n  take   key \nand more") == "take key"
