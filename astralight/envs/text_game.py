"""The text-game example's games and warm start (``examples/text_game``).

:func:`build_text_game` is the recipe's ``prepare`` step. It generates small TextWorld games
locally (:func:`make_text_games`: one room, a few objects, quests of one or two commands, the
``basic`` grammar whose names -- ``thing55``, ``box4``, ``R-key`` -- differ from game to game),
splits them by name into train and held-out games exactly as the recipe's prompt source does
(:class:`~astralight.envs.textworld_tasks.TextWorldGames`), and warm-starts the tiny chat model
on conversations of the train games only, laid out as
:class:`~astralight.workflows.chat_env.ChatEnvWorkflow` lays out an episode.

What the warm start teaches, and what it leaves to RL (:func:`text_game_conversations`): a
``1 - wrong_share`` share of the conversations plays the game's walkthrough (each command copied
out of the objective: ``First, take the thing3 from the box5. Next, insert thing3 into box44.``
-> ``take thing3 from box5``, ``insert thing3 into box44``); the others play ``wrong_moves``
commands that do not advance the quest (:func:`wrong_play_conversation`): an admissible command
of the current state (``examine box44``, ``look``, ``close box5``) or another game's command,
which this game does not accept (``unlock L-box with L-key`` where there is no L-box; counted in
``invalid_actions``). So at temperature 1.0 the warm-started policy plays the quest in some
episodes and wanders in others, and it miscopies names now and then. On held-out games (names it
never saw) the win reward pays only the first way played right, so RL has a preference to learn
(wander less) and a skill to sharpen (copy the command faithfully); the share of commands the game
does not accept falls as it does. Every observation is the real one, played through
:class:`~astralight.envs.textworld_env.TextWorldEnv` with the recipe's environment kwargs; each
conversation is then a copy with new names (:func:`rename_conversation`): on a few dozen games
as they are, the tiny model memorised their names and won 0.007 of held-out episodes (0.53 of
train ones), so names vary and what it learns is to copy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np

from astralight.envs.textworld_env import TextWorldEnv, game_record, make_games
from astralight.envs.textworld_tasks import is_eval_game
from astralight.envs.textworld_warmstart import walkthrough_conversation
from astralight.protocol import Task
from astralight.tasks.sft_loop import Progress
from astralight.trainer.tinymodel import CHAT_MODEL_SPEC
from astralight.workflows.chat_env import first_messages

__all__ = ["TEXT_GAME_ENV_KWARGS", "TEXT_GAME_SYSTEM_PROMPT", "make_text_games",
           "split_games", "wrong_play_conversation", "rename_conversation",
           "text_game_conversations", "build_text_game"]

#: the recipe's environment kwargs: short texts (every character is a token of a 512-position
#: model), so an episode of three turns fits
TEXT_GAME_ENV_KWARGS: dict = {"reward": "win", "max_obs_chars": 60, "max_intro_chars": 180}
#: the recipe's system prompt: none (the first observation states the objective; every
#: character saved is a token)
TEXT_GAME_SYSTEM_PROMPT = ""


def make_text_games(games_dir: str | Path, n_games: int, seed: int = 0,
                    quest_lengths: Sequence[int] = (1, 2), nb_rooms: int = 1,
                    nb_objects: int = 3) -> list[Path]:
    """``n_games`` games in ``games_dir``, the quest lengths taking turns (game ``i`` has
    ``quest_lengths[i % len]`` commands and seed ``seed + i``); objectives name every command
    (``only_last_action=False``). Games already there are kept (about 2 s a new game)."""
    if n_games < 1:
        raise ValueError(f"n_games: must be >= 1, got {n_games}")
    if not quest_lengths or any(int(q) < 1 for q in quest_lengths):
        raise ValueError(f"quest_lengths: one or more lengths >= 1, got {quest_lengths}")
    paths = []
    for i in range(n_games):
        q = int(quest_lengths[i % len(quest_lengths)])
        paths += make_games(games_dir, 1, seed=seed + i, nb_rooms=nb_rooms, nb_objects=nb_objects,
                            quest_length=q, only_last_action=False)
    return paths


def split_games(games: Sequence[str | Path], eval_share: float) -> tuple[list[Path], list[Path]]:
    """``(train, eval)``: the split :class:`~astralight.envs.textworld_tasks.TextWorldGames`
    makes with the same ``eval_share`` (by a hash of the game's name)."""
    train, held = [], []
    for g in map(Path, games):
        (held if is_eval_game(g.stem, eval_share) else train).append(g)
    return train, held


def wrong_play_conversation(game: str | Path, rng: np.random.Generator, foreign: Sequence[str],
                            moves: int = 3, foreign_share: float = 0.5,
                            system_prompt: str = TEXT_GAME_SYSTEM_PROMPT,
                            env_kwargs: dict | None = None) -> list[dict]:
    """``game`` played with ``moves`` commands that do not advance its quest, as chat messages
    ending with the last command: each is, with probability ``foreign_share``, a command of
    ``foreign`` (other games' commands) that this game does not accept now, else an admissible
    command that is not in the walkthrough. Stops early if the game ends (it never wins: a move
    that scores is replaced)."""
    if moves < 1:
        raise ValueError(f"moves: must be >= 1, got {moves}")
    env = TextWorldEnv(**(env_kwargs or {}))
    try:
        task = Task(task_id=Path(game).stem, prompt="", n=1, model_ids=[],
                    metadata={env.game_key: str(game)})
        messages = first_messages(system_prompt, env.reset(task))
        quest = set(game_record(env.game_path)["walkthrough"])
        for move in range(moves):
            inside = sorted(c for c in env.admissible if c not in quest)
            outside = [c for c in foreign if c not in env.admissible]
            use_foreign = outside and (not inside or rng.random() < foreign_share)
            pool = outside if use_foreign else inside
            if not pool:
                break
            command = str(pool[rng.integers(len(pool))])
            messages.append({"role": "assistant", "content": command})
            observation, reward, done = env.step(command)
            if reward > 0 or env.won:  # pragma: no cover - a non-quest command never scores here
                raise ValueError(f"game {game}: {command!r} scored; it is not a wrong move")
            if done or move + 1 == moves:
                break
            messages.append({"role": "user", "content": observation})
        return messages
    finally:
        env.close()


#: the names the ``basic`` grammar gives objects and rooms: a kind and a number (``thing55``,
#: ``Room22``) or a letter and a kind (``R-box`` and its ``R-key``)
_NUMBERED = re.compile(r"\b(thing|box|stand|snack|key|room|Room)(\d+)\b")
_LETTERED = re.compile(r"\b([A-Z])-(box|key)\b")


def rename_conversation(conversation: Sequence[dict], rng: np.random.Generator) -> list[dict]:
    """``conversation`` with every object and room renamed consistently (each numbered name of a
    kind gets another number, distinct within the kind; each lettered box/key pair another
    letter): the same game with other names, as TextWorld's grammar would have written it.

    Why: a tiny model warm-started on a few dozen games memorises their names, and on a held-out
    game it plays a train game's command. Renamed copies of the same games show it thousands of
    names, so it learns to copy the command out of the objective instead."""
    texts = [m["content"] for m in conversation]
    numbered = sorted({(kind.lower(), n) for t in texts for kind, n in _NUMBERED.findall(t)})
    letters = sorted({letter for t in texts for letter, _ in _LETTERED.findall(t)})
    numbers: dict[tuple[str, str], str] = {}
    for kind in sorted({k for k, _ in numbered}):
        names = [n for k, n in numbered if k == kind]
        picks = rng.choice(100, size=len(names), replace=False)
        numbers.update({(kind, n): str(int(v)) for n, v in zip(names, picks)})
    picks = rng.choice(26, size=len(letters), replace=False)
    new_letters = {old: chr(ord("A") + int(v)) for old, v in zip(letters, picks)}

    def rename(text: str) -> str:
        text = _NUMBERED.sub(lambda m: m.group(1) + numbers[(m.group(1).lower(), m.group(2))], text)
        return _LETTERED.sub(lambda m: new_letters[m.group(1)] + "-" + m.group(2), text)

    return [{**m, "content": rename(m["content"])} for m in conversation]


def text_game_conversations(games: Sequence[str | Path], count: int, wrong_share: float = 0.5,
                            wrong_variants: int = 3, wrong_moves: int = 3,
                            foreign_share: float = 0.5, seed: int = 0,
                            system_prompt: str = TEXT_GAME_SYSTEM_PROMPT,
                            env_kwargs: dict | None = None,
                            rename: bool = True) -> list[list[dict]]:
    """``count`` warm-start conversations over ``games``: each picks a game at random, then its
    walkthrough (``1 - wrong_share`` of them) or one of its ``wrong_variants`` wrong plays
    (:func:`wrong_play_conversation`, ``wrong_moves`` commands, the foreign ones drawn from the
    other games' walkthroughs); with ``rename``, each a copy with new names
    (:func:`rename_conversation`)."""
    if not games:
        raise ValueError("games: the warm start needs at least one game")
    if not 0.0 <= wrong_share <= 1.0:
        raise ValueError(f"wrong_share: must be in [0, 1], got {wrong_share}")
    if count < 1 or wrong_variants < 1:
        raise ValueError(f"count and wrong_variants: must be >= 1, got {count}, {wrong_variants}")
    kwargs = dict(env_kwargs or {})
    rng = np.random.default_rng([seed, 37])
    walks = [walkthrough_conversation(g, system_prompt, kwargs) for g in games]
    commands = sorted({m["content"] for w in walks for m in w if m["role"] == "assistant"})
    wrong: list[list[list[dict]]] = []
    if wrong_share > 0:
        for g in games:
            own = set(game_record(g)["walkthrough"])
            foreign = [c for c in commands if c not in own]
            wrong.append([wrong_play_conversation(g, rng, foreign, wrong_moves, foreign_share,
                                                  system_prompt, kwargs)
                          for _ in range(wrong_variants)])
    out = []
    for _ in range(int(count)):
        i = int(rng.integers(len(games)))
        if wrong_share > 0 and rng.random() < wrong_share:
            conversation = wrong[i][int(rng.integers(wrong_variants))]
        else:
            conversation = walks[i]
        out.append(rename_conversation(conversation, rng) if rename else conversation)
    return out


def build_text_game(out_dir: str | Path, games_dir: str | Path, n_games: int = 120,
                    seed: int = 0, quest_lengths: Sequence[int] = (1, 2),
                    eval_share: float = 0.25, wrong_share: float = 0.5, wrong_variants: int = 3,
                    wrong_moves: int = 3, foreign_share: float = 0.5, conversations: int = 4000,
                    rename: bool = True, env_kwargs: dict | None = None,
                    system_prompt: str = TEXT_GAME_SYSTEM_PROMPT, sft_steps: int = 300,
                    lr: float = 5e-3, batch_size: int = 32, progress: Progress | bool = True,
                    num_threads: int | None = 1) -> Path:
    """The text-game recipe's ``prepare`` step: ``n_games`` games into ``games_dir``
    (:func:`make_text_games`), then the tiny chat model warm-started at ``out_dir`` on
    ``conversations`` conversations of the train games (:func:`text_game_conversations`; the
    held-out ``eval_share``, split as the recipe's prompt source splits, is never seen).
    ``env_kwargs`` and ``system_prompt`` must be the workflow's (defaults:
    :data:`TEXT_GAME_ENV_KWARGS`, :data:`TEXT_GAME_SYSTEM_PROMPT`)."""
    from astralight.tasks.chat_warmstart import build_chat_policy

    games = make_text_games(games_dir, n_games, seed, quest_lengths)
    train, held = split_games(games, eval_share)
    if not train or not held:
        raise ValueError(f"n_games={n_games}, eval_share={eval_share}: {len(train)} train and "
                         f"{len(held)} held-out games; both must be non-empty")
    kwargs = dict(TEXT_GAME_ENV_KWARGS if env_kwargs is None else env_kwargs)
    return build_chat_policy(
        out_dir, lambda: text_game_conversations(train, conversations, wrong_share,
                                                 wrong_variants, wrong_moves, foreign_share, seed,
                                                 system_prompt, kwargs, rename),
        sft_steps=sft_steps, lr=lr, batch_size=batch_size, seed=seed, progress=progress,
        num_threads=num_threads,
        provenance={"task": "text_game", "train_games": len(train), "eval_games": len(held),
                    "eval_share": eval_share, "quest_lengths": list(quest_lengths),
                    "wrong_share": wrong_share, "wrong_variants": wrong_variants,
                    "wrong_moves": wrong_moves, "foreign_share": foreign_share, "rename": rename,
                    "system_prompt": system_prompt, "env_kwargs": kwargs})


#: the vocabulary of the model it builds, before it is built (astralight.launch.prepared_vocab_size)
build_text_game.vocab_size = lambda **_: CHAT_MODEL_SPEC.vocab_size
