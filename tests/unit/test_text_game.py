"""The text-game example (examples/text_game): its games, the train/held-out split the prepare step
and the recipe's prompt sources share, the warm start's walkthrough and wrong-play conversations
(played through the real TextWorld games; they fit the episode budget and never win), the recipe
(dataflow sources and the chat_env workflow build, and agree with the warm start), and the
trainer's ``agent/invalid_actions`` scalar read from the episodes' outcome."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from astralight.agents.stats import batch_scalars, invalid_actions_of
from astralight.protocol import Task

pytest.importorskip("textworld")

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "text_game" / "recipe.yaml"


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """Six one-room games, quests of one and two commands taking turns (~2 s a game)."""
    from astralight.envs.text_game import make_text_games

    out = tmp_path_factory.mktemp("text_games")
    return make_text_games(out, 6, seed=0, quest_lengths=(1, 2))


def test_games_alternate_quest_lengths_and_name_every_command(games):
    from astralight.envs.textworld_env import game_record

    assert [g.stem.split("-")[4] for g in games] == ["q1", "q2"] * 3
    for g in games:
        record = game_record(g)
        assert len(record["walkthrough"]) == int(g.stem.split("-")[4][1:])
        if len(record["walkthrough"]) == 2:  # only_last_action=False: both steps are stated
            assert record["objective"].startswith("First,")


def test_the_split_is_the_prompt_sources_split(games):
    from astralight.envs.text_game import split_games
    from astralight.envs.textworld_tasks import TextWorldGames

    train, held = split_games(games, 0.5)
    assert sorted(train + held) == sorted(games) and train and held
    root = str(games[0].parent)
    assert TextWorldGames(root, "train", 0.5).games == sorted(train)
    assert TextWorldGames(root, "eval", 0.5).games == sorted(held)


def test_a_wrong_play_never_advances_the_quest(games):
    from astralight.envs.text_game import TEXT_GAME_ENV_KWARGS, wrong_play_conversation
    from astralight.envs.textworld_env import TextWorldEnv, game_record

    foreign = ["unlock Z-box with Z-key", "take thing999 from box999"]
    for g in games:
        quest = game_record(g)["walkthrough"]
        for seed in range(3):
            conv = wrong_play_conversation(g, np.random.default_rng(seed), foreign, moves=3,
                                           env_kwargs=TEXT_GAME_ENV_KWARGS)
            commands = [m["content"] for m in conv if m["role"] == "assistant"]
            assert conv[0]["role"] == "user" and conv[-1]["role"] == "assistant"
            assert 1 <= len(commands) <= 3 and not set(commands) & set(quest)
            env = TextWorldEnv(**TEXT_GAME_ENV_KWARGS)  # replay: nothing scores, nothing wins
            env.reset(Task(task_id="g", prompt="", n=1, model_ids=[], metadata={"game": str(g)}))
            assert sum(env.step(c)[1] for c in commands) == 0 and not env.won
            env.close()
    # all foreign: every command is one the game does not accept
    conv = wrong_play_conversation(games[0], np.random.default_rng(0), foreign, moves=2,
                                   foreign_share=1.0, env_kwargs=TEXT_GAME_ENV_KWARGS)
    assert [m["content"] for m in conv if m["role"] == "assistant"][0] in foreign
    assert conv[2]["content"] == "You can't see any such thing."


def test_renaming_is_consistent_and_keeps_every_other_word():
    from astralight.envs.text_game import rename_conversation

    conv = [{"role": "user", "content": "First, take the thing3 from the box5. Next, insert "
                                        "thing3 into box44.\n-= Room4 =-\nYou are in the room4.\n"
                                        "There is a R-key and a thing30. You can't see any such thing."},
            {"role": "assistant", "content": "take thing3 from box5"},
            {"role": "user", "content": "You take the thing3 from the box5."},
            {"role": "assistant", "content": "unlock R-box with R-key"}]
    seen = set()
    for seed in range(20):
        new = rename_conversation(conv, np.random.default_rng(seed))
        text = new[0]["content"]
        thing, box5 = new[1]["content"].split()[1], new[1]["content"].split()[3]
        assert new[2]["content"] == f"You take the {thing} from the {box5}."
        assert text.startswith(f"First, take the {thing} from the {box5}. Next, insert {thing} into box")
        letter = new[3]["content"][7]
        assert new[3]["content"] == f"unlock {letter}-box with {letter}-key" and f"a {letter}-key" in text
        room = text.split("-= ")[1].split(" =-")[0]
        assert f"You are in the {room.lower()}." in text and "any such thing." in text
        assert [m["role"] for m in new] == [m["role"] for m in conv]
        seen.add(thing)
    assert len(seen) > 10  # names vary
    # distinct names stay distinct: thing3 and thing30 never merge
    for seed in range(50):
        text = rename_conversation(conv, np.random.default_rng(seed))[0]["content"]
        assert len(set(re.findall(r"thing\d+", text))) == 2


def test_conversations_mix_walkthroughs_and_wrong_play_and_fit_the_model(games):
    from astralight.envs.text_game import TEXT_GAME_ENV_KWARGS, text_game_conversations
    from astralight.envs.textworld_env import game_record
    from astralight.tasks.chat_warmstart import transcript_of
    from astralight.trainer.tinymodel import CHAT_MODEL_SPEC, build_chat_tokenizer

    convs = text_game_conversations(games, 200, wrong_share=0.5, wrong_variants=2, seed=0,
                                    env_kwargs=TEXT_GAME_ENV_KWARGS, rename=False)
    walks = {tuple(game_record(g)["walkthrough"]) for g in games}
    played = [tuple(m["content"] for m in c if m["role"] == "assistant") for c in convs]
    share = sum(p not in walks for p in played) / len(played)
    assert 0.35 < share < 0.65
    tok = build_chat_tokenizer()
    assert max(len(transcript_of(tok, c)) for c in convs) < CHAT_MODEL_SPEC.max_position_embeddings
    only_walks = text_game_conversations(games, 20, wrong_share=0.0, env_kwargs=TEXT_GAME_ENV_KWARGS,
                                         rename=False)
    assert all(tuple(m["content"] for m in c if m["role"] == "assistant") in walks
               for c in only_walks)
    renamed = text_game_conversations(games, 100, wrong_share=0.0, env_kwargs=TEXT_GAME_ENV_KWARGS)
    firsts = {c[0]["content"] for c in renamed}
    assert len(firsts) > 50  # same games, other names: far more than six openings
    assert max(len(transcript_of(tok, c)) for c in renamed) < CHAT_MODEL_SPEC.max_position_embeddings
    with pytest.raises(ValueError, match="wrong_share"):
        text_game_conversations(games, 10, wrong_share=1.5)


def test_the_recipe_builds_and_matches_its_warm_start(games, tmp_path):
    from astralight.dataflow.config import DataflowConfig, build_plugins, instantiate_plugin
    from astralight.envs.text_game import (TEXT_GAME_ENV_KWARGS, TEXT_GAME_SYSTEM_PROMPT,
                                           build_text_game)
    from astralight.launch import prepared_vocab_size
    from astralight.launch.recipe import load_recipe, substitute
    from astralight.raas.config import build_parser
    from astralight.tasks.base import PromptSource
    from astralight.trainer.tinymodel import CHAT_MODEL_SPEC
    from astralight.workflows.chat_env import ChatEnvWorkflow

    recipe = substitute(load_recipe(RECIPE), {"run_dir": tmp_path})
    prep = recipe["prepare"]
    assert prep["function"] == "astralight.envs.text_game.build_text_game"
    assert prepared_vocab_size(recipe) == CHAT_MODEL_SPEC.vocab_size
    games_dir = Path(prep["kwargs"]["games_dir"])
    games_dir.mkdir(parents=True)
    for g in games:  # a small stand-in for the games the prepare step generates
        for suffix in (".z8", ".json"):
            (games_dir / g.with_suffix(suffix).name).write_bytes(g.with_suffix(suffix).read_bytes())
    df = DataflowConfig(**recipe["dataflow"])
    build_plugins(df)
    assert df.workflow == ChatEnvWorkflow.name
    eval_share = prep["kwargs"]["eval_share"]
    train = instantiate_plugin(df.source, PromptSource, "source")
    held = instantiate_plugin(df.eval.source, PromptSource, "eval.source")
    assert train.eval_share == held.eval_share == eval_share
    assert not {p.name for p in train.games} & {p.name for p in held.games}
    parser = build_parser()
    raas = recipe["raas"][0]
    cfg = parser.parse_object({k: v for k, v in raas.items() if k != "engines"} | {"engines": {}})
    wf = parser.instantiate_classes(cfg).workflow
    assert isinstance(wf, ChatEnvWorkflow)
    assert wf.environment_kwargs == TEXT_GAME_ENV_KWARGS and "env_kwargs" not in prep["kwargs"]
    assert wf.system_prompt == TEXT_GAME_SYSTEM_PROMPT and "system_prompt" not in prep["kwargs"]
    assert wf.max_total_tokens <= raas["engines"]["policy"]["max_model_len"] <= 512
    assert recipe["trainers"][0]["trainer"]["max_steps"] == recipe["stop"]["versions"]
    assert recipe["dataflow"]["max_staleness"] == 1
    with pytest.raises(ValueError, match="held-out"):  # no held-out game among one
        build_text_game(tmp_path / "model", games_dir, n_games=1, eval_share=0.01)


def test_the_trainer_counts_the_commands_the_game_did_not_accept():
    def episode(invalid, turns=3):
        return {"tool_calls": 0, "tool_errors": {}, "turns": turns,
                "env": {"won": False, "invalid_actions": invalid}}

    assert invalid_actions_of(episode(2)) == 2
    assert invalid_actions_of({"env": {"won": True}}) is None and invalid_actions_of(None) is None
    scalars = batch_scalars([episode(2), episode(0), episode(1)])
    assert scalars["invalid_actions"] == pytest.approx(1.0) and scalars["turns"] == 3.0
    # a tool workflow's episodes have no environment outcome: no such scalar
    assert "invalid_actions" not in batch_scalars([{"tool_calls": 1, "turns": 2}])


def test_games_load_and_play_on_many_threads_at_once(games):
    """TextWorld parses a game's logic with one module-level parser that is not thread-safe;
    episodes reset at once on executor threads (as ChatEnvWorkflow runs them) must all load."""
    from concurrent.futures import ThreadPoolExecutor

    from astralight.envs.text_game import TEXT_GAME_ENV_KWARGS
    from astralight.envs.textworld_env import TextWorldEnv, game_record

    def play(game):
        env = TextWorldEnv(**TEXT_GAME_ENV_KWARGS)
        try:
            env.reset(Task(task_id="g", prompt="", n=1, model_ids=[], metadata={"game": str(game)}))
            rewards = [env.step(c)[1] for c in game_record(game)["walkthrough"]]
            return env.won and rewards[-1] == 1.0
        finally:
            env.close()

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(play, list(games) * 4))
