"""Scripted chat conversations of TextWorld games (their walkthroughs) for a chat warm start.

A random tiny model never writes a game command, so RL on text games starts from a supervised
warm start (:func:`astralight.tasks.chat_warmstart.build_chat_policy`) on conversations laid out
exactly as :class:`~astralight.workflows.chat_env.ChatEnvWorkflow` lays out an episode: the
system prompt and the game's first observation, then each walkthrough command as an assistant
turn and the game's answer as the next user message. The observations are the real ones: every
conversation is played through :class:`~astralight.envs.textworld_env.TextWorldEnv` with the
environment kwargs the workflow will use, so the warm start sees the very text RL will.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from astralight.envs.textworld_env import TextWorldEnv, game_record
from astralight.protocol import Task
from astralight.tasks.warmstart import Progress
from astralight.workflows.chat_env import first_messages

#: the system prompt of the text-game recipes (short: every character is a token)
TEXTWORLD_SYSTEM_PROMPT = "Play the game. Answer with one command."


def walkthrough_conversation(game: str | Path, system_prompt: str = TEXTWORLD_SYSTEM_PROMPT,
                             env_kwargs: dict | None = None) -> list[dict]:
    """``game``'s walkthrough played through the environment, as chat messages ending with the
    winning command; ValueError if the walkthrough does not win (a broken game)."""
    env = TextWorldEnv(**(env_kwargs or {}))
    try:
        task = Task(task_id=Path(game).stem, prompt="", n=1, model_ids=[],
                    metadata={env.game_key: str(game)})
        messages = first_messages(system_prompt, env.reset(task))
        walkthrough = game_record(env.game_path)["walkthrough"]
        done = False
        for command in walkthrough:
            messages.append({"role": "assistant", "content": command})
            observation, _, done = env.step(command)
            if done:
                break
            messages.append({"role": "user", "content": observation})
        if not (done and env.won):
            raise ValueError(f"game {game}: its walkthrough {walkthrough} does not win it")
        return messages
    finally:
        env.close()


def walkthrough_conversations(games: Sequence[str | Path], repeat: int = 1,
                              system_prompt: str = TEXTWORLD_SYSTEM_PROMPT,
                              env_kwargs: dict | None = None) -> list[list[dict]]:
    """One walkthrough conversation per game, each ``repeat`` times (a batch draws from them)."""
    if repeat < 1:
        raise ValueError(f"repeat: must be >= 1, got {repeat}")
    if not games:
        raise ValueError("games: the warm start needs at least one game")
    once = [walkthrough_conversation(g, system_prompt, env_kwargs) for g in games]
    return [c for c in once for _ in range(repeat)]


def build_textworld_policy(out_dir: str | Path, games: Sequence[str | Path],
                           system_prompt: str = TEXTWORLD_SYSTEM_PROMPT,
                           env_kwargs: dict | None = None, sft_steps: int = 300,
                           lr: float = 5e-3, batch_size: int = 16, seed: int = 0,
                           progress: Progress | bool = False,
                           num_threads: int | None = None) -> Path:
    """The tiny chat model warm-started on the walkthroughs of ``games``, saved at ``out_dir``."""
    from astralight.tasks.chat_warmstart import build_chat_policy

    return build_chat_policy(
        out_dir, lambda: walkthrough_conversations(games, 1, system_prompt, env_kwargs),
        sft_steps=sft_steps, lr=lr, batch_size=batch_size, seed=seed, progress=progress,
        num_threads=num_threads,
        provenance={"task": "textworld", "games": [Path(g).name for g in games],
                    "system_prompt": system_prompt, "env_kwargs": dict(env_kwargs or {})})
