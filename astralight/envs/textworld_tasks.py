"""A folder of TextWorld games as a prompt source, split into train and eval games.

Every ``*.z8`` game with its ``.json`` in ``games_dir`` (sorted by name) is one prompt: its id is
the file stem, its text the game's objective (what logs and curators see; the episode's first
observation comes from the environment's ``reset``), its metadata ``{"game": path,
"walkthrough": [...]}`` -- the path is what :class:`~astralight.envs.textworld_env.TextWorldEnv`
plays, the walkthrough what a warm start or a check may use (no reward reads it).

A game is held out for eval iff a hash of its name falls in ``eval_share``, so the split does not
change when games are added, and a game never moves between splits.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from astralight.envs.textworld_env import GAME_SUFFIX, game_record
from astralight.tasks.base import Prompt, PromptSource, check_index

SPLITS = ("train", "eval", "all")


def is_eval_game(name: str, eval_share: float) -> bool:
    """Whether the game named ``name`` belongs to the held-out split."""
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < eval_share


def list_games(games_dir: str | Path, suffix: str = GAME_SUFFIX) -> list[Path]:
    """The playable games of ``games_dir``, sorted by name (a game needs its ``.json``)."""
    root = Path(games_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"games_dir: {root} is not a folder; generate games into it "
                                "with astralight.envs.textworld_env.make_games")
    return sorted(p for p in root.glob(f"*{suffix}") if p.with_suffix(".json").is_file())


class TextWorldGames(PromptSource):
    """The games of ``games_dir`` as prompts (``split``: ``"train"``, ``"eval"`` or ``"all"``).

    Args:
        games_dir: the folder :func:`~astralight.envs.textworld_env.make_games` wrote.
        split: which games: the train share, the held-out share, or all of them.
        eval_share: fraction of games held out (by a hash of the name).
        relative_paths: put paths relative to ``games_dir`` in the metadata (give the
            environment the same ``games_dir``), e.g. when the RaaS sees the folder elsewhere.
    """

    def __init__(self, games_dir: str, split: str = "train", eval_share: float = 0.2,
                 relative_paths: bool = False):
        if split not in SPLITS:
            raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
        if not 0.0 <= eval_share < 1.0:
            raise ValueError(f"eval_share: must be in [0, 1), got {eval_share}")
        self.games_dir = Path(games_dir).expanduser()
        self.split, self.eval_share = split, eval_share
        self.relative_paths = relative_paths
        games = list_games(self.games_dir)
        if split != "all":
            games = [g for g in games if is_eval_game(g.stem, eval_share) == (split == "eval")]
        if not games:
            raise ValueError(f"games_dir: no {split} games in {self.games_dir} (eval_share="
                             f"{eval_share}); generate more games, or change split / eval_share")
        self.games = games

    def __len__(self) -> int:
        return len(self.games)

    def get(self, index: int) -> Prompt:
        path = self.games[check_index(index, len(self.games), "game", self.games_dir)]
        record = game_record(path)
        where = path.relative_to(self.games_dir) if self.relative_paths else path
        return Prompt(prompt_id=path.stem, prompt=record["objective"] or path.stem,
                      metadata={"game": str(where), "walkthrough": record["walkthrough"]})
