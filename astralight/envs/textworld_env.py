"""TextWorld games as an astralight :class:`~astralight.workflows.multi_turn.Environment`.

Games come from TextWorld's own generator (:func:`make_games`: seeded ``textworld.make`` with
few rooms and objects and a short quest, compiled by the Inform 7 compiler that the ``textworld``
wheel ships), so nothing is downloaded. Each game is a ``.z8`` file with its ``.json`` beside it
(TextWorld's record of the world, used to track the state, the score and the admissible commands).

:class:`TextWorldEnv` plays the game named by ``task.metadata["game"]`` through
``textworld.start`` (Jericho runs the ``.z8``; every instance loads its own copy of the
interpreter library, so episodes on executor threads do not share state):

- ``reset(task)`` -> the game's opening text (the objective and the first room), cleaned by
  :func:`astralight.envs.text.clean_observation` (banner, prompt and status line dropped, ASCII,
  at most ``max_intro_chars``);
- ``step(action)`` -> ``(observation, reward, done)``: the action's first line is the command;
  the observation is the game's answer, cleaned, at most ``max_obs_chars``; ``done`` when the
  game is won or lost.

Reward (``reward`` field): ``"score"`` (default) is TextWorld's score change on this step (the
points the command earned; an episode's sum is its final score), ``"normalized"`` the same divided
by the game's ``max_score`` (an episode's sum is 1.0 when every point is earned), ``"win"`` 1.0 on
the step that wins and 0.0 otherwise. Losing costs nothing beyond the points not earned.

:meth:`TextWorldEnv.metrics` (read by :class:`astralight.workflows.chat_env.ChatEnvWorkflow` into
the sample's metadata) says ``won``, ``lost``, ``score``, ``max_score``, ``moves`` and
``invalid_actions``: commands that were not among the state's admissible commands (TextWorld
lists them anyway to track the game, so counting is free).
"""

from __future__ import annotations

import json
import logging
import threading
import warnings
from pathlib import Path
from typing import Any

from astralight.envs.text import clean_observation, first_line
from astralight.protocol import Task
from astralight.workflows.multi_turn import Environment

log = logging.getLogger(__name__)

REWARD_MODES = ("score", "normalized", "win")
#: held while a game loads: TextWorld parses a game's logic with one module-level parser (tatsu),
#: which is not thread-safe -- episodes that reset at once on executor threads failed with
#: IndexError / TypeError inside the parser
_LOAD_LOCK = threading.Lock()
#: the game files TextWorld 1.7 plays with text observations (``.json`` alone has no text)
GAME_SUFFIX = ".z8"


def _textworld():
    try:
        import textworld
    except ImportError as exc:  # pragma: no cover - textworld is a dependency of this module
        raise ImportError("TextWorldEnv needs TextWorld: pip install textworld") from exc
    # TextWorld's Jericho backend asks Jericho for valid actions on every step, which Jericho
    # cannot give for TextWorld's games (it warns each time); the admissible commands come from
    # TextWorld's own tracking of the game instead, so the warning says nothing here. A filter,
    # not catch_warnings: episodes step on several threads and catch_warnings is not thread-safe.
    warnings.filterwarnings("ignore", message="Unable to find valid actions in an unsupported game")
    return textworld


def game_name(seed: int, nb_rooms: int, nb_objects: int, quest_length: int, theme: str) -> str:
    """The file stem :func:`make_games` gives a game (its options and seed, so names are stable)."""
    return f"tw-{theme}-r{nb_rooms}-o{nb_objects}-q{quest_length}-s{seed}"


def make_games(out_dir: str | Path, count: int, seed: int = 0, nb_rooms: int = 1,
               nb_objects: int = 3, quest_length: int = 1, theme: str = "basic",
               only_last_action: bool = True) -> list[Path]:
    """Generate ``count`` small games into ``out_dir``; returns their ``.z8`` paths.

    Game ``i`` is ``textworld.make`` with seed ``seed + i`` (the same seed makes the same game):
    ``nb_rooms`` rooms, ``nb_objects`` objects, a quest of ``quest_length`` commands, the text
    grammar ``theme`` (``"basic"``: plain names such as ``room0``, ``box22`` and short
    sentences; ``"house"``: TextWorld's wordier default), and with ``only_last_action`` an
    objective that names only the quest's last command. A game already in ``out_dir`` (same
    name, with its ``.json``) is kept, not regenerated. About a second per game (the Inform 7
    compiler runs once per game).
    """
    textworld = _textworld()
    if count < 1:
        raise ValueError(f"count: must be >= 1, got {count}")
    if nb_rooms < 1 or nb_objects < 0 or quest_length < 1:
        raise ValueError(f"nb_rooms >= 1, nb_objects >= 0 and quest_length >= 1 needed, got "
                         f"{nb_rooms}, {nb_objects}, {quest_length}")
    if theme not in ("basic", "house"):
        raise ValueError(f"theme: TextWorld's grammars are 'basic' and 'house', got {theme!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = out / (game_name(seed + i, nb_rooms, nb_objects, quest_length, theme) + GAME_SUFFIX)
        if not (path.is_file() and path.with_suffix(".json").is_file()):
            opts = textworld.GameOptions()
            opts.seeds = seed + i
            opts.nb_rooms, opts.nb_objects, opts.quest_length = nb_rooms, nb_objects, quest_length
            opts.grammar.theme = theme
            opts.grammar.only_last_action = only_last_action
            opts.path = str(path)
            opts.file_ext = GAME_SUFFIX
            opts.force_recompile = True
            made, _ = textworld.make(opts)
            if Path(made) != path:  # pragma: no cover - textworld honours opts.path
                raise RuntimeError(f"textworld.make wrote {made}, expected {path}")
        paths.append(path)
    return paths


def game_record(path: str | Path) -> dict:
    """What a game's ``.json`` says that a task needs: ``objective`` and ``walkthrough``."""
    data = json.loads(Path(path).with_suffix(".json").read_text())
    meta = data.get("metadata") or {}
    return {"objective": str(data.get("objective") or ""),
            "walkthrough": [str(c) for c in (meta.get("walkthrough") or [])]}


def resolve_game(task: Task, key: str, games_dir: str | None, suffixes: tuple[str, ...],
                 env_name: str, what: str, file_in_folder: str = "") -> Path:
    """The game file of ``task`` (``task.metadata[key]``, relative paths under ``games_dir``; a
    folder means its ``file_in_folder`` when given); KeyError / FileNotFoundError / ValueError
    naming the field and the fix otherwise."""
    if key not in task.metadata:
        raise KeyError(f"task.metadata: {env_name} needs {key!r} (the path of {what}), got "
                       f"{sorted(task.metadata)} (task {task.task_id}); list a games folder with "
                       "its prompt source")
    path = Path(str(task.metadata[key])).expanduser()
    if not path.is_absolute() and games_dir:
        path = Path(games_dir).expanduser() / path
    if file_in_folder and path.is_dir():
        path = path / file_in_folder
    if path.suffix not in suffixes:
        raise ValueError(f"task.metadata[{key!r}]: {path} is not {what} (expected "
                         f"{' or '.join(suffixes)}; task {task.task_id})")
    if not path.is_file():
        raise FileNotFoundError(f"task.metadata[{key!r}]: no game at {path} (task "
                                f"{task.task_id}); check the path or games_dir")
    return path


class TextGameEnv(Environment):
    """What the text-game adapters share: the checks and parsing of an action, counting the
    commands that are not admissible, and letting go of the game.

    A subclass keeps ``env`` (the running game, None before ``reset``), ``game_path``, ``done``,
    ``admissible`` (the commands the game accepts now), ``invalid`` and ``max_action_chars``."""

    env: Any = None
    game_path: Path | None = None

    def _command(self, action: str) -> tuple[str, bool]:
        """The command in ``action`` (its first line, capped) and whether it is admissible;
        RuntimeError before ``reset`` or after the game ended."""
        name = type(self).__name__
        if self.env is None:
            raise RuntimeError(f"{name}.step: call reset(task) first")
        if self.done:
            raise RuntimeError(f"{name}.step: the game is over; reset for a new episode")
        command = first_line(action, self.max_action_chars)
        admissible = command in self.admissible
        if not admissible:
            self.invalid += 1
        return command, admissible

    def close(self) -> None:
        """Let go of the game (a TextWorld game holds a copy of Jericho's interpreter)."""
        if self.env is not None:
            try:
                self.env.close()
            except Exception:  # noqa: BLE001 - closing a finished game must not fail an episode
                log.debug("closing %s failed", self.game_path, exc_info=True)
            self.env = None


class TextWorldEnv(TextGameEnv):
    """One episode of a TextWorld game (see the module doc for observations and reward).

    Args:
        game_key: the task metadata field with the game's path (a ``.z8`` file).
        games_dir: where relative game paths are (None: the working directory).
        reward: ``"score"`` | ``"normalized"`` | ``"win"``.
        max_obs_chars: most characters of a step's observation.
        max_intro_chars: most characters of the first observation (objective and first room).
        max_action_chars: a longer command is cut.
    """

    def __init__(self, game_key: str = "game", games_dir: str | None = None,
                 reward: str = "score", max_obs_chars: int = 200, max_intro_chars: int = 400,
                 max_action_chars: int = 200):
        if reward not in REWARD_MODES:
            raise ValueError(f"reward: must be one of {REWARD_MODES}, got {reward!r}")
        for name, value in (("max_obs_chars", max_obs_chars), ("max_intro_chars", max_intro_chars),
                            ("max_action_chars", max_action_chars)):
            if int(value) < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        self.game_key, self.games_dir, self.reward_mode = game_key, games_dir, reward
        self.max_obs_chars, self.max_intro_chars = int(max_obs_chars), int(max_intro_chars)
        self.max_action_chars = int(max_action_chars)
        self.env: Any = None
        self.game_path: Path | None = None
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.score, self.max_score, self.moves, self.invalid = 0, 0, 0, 0
        self.won = self.lost = self.done = False
        self.admissible: set[str] = set()

    def reset(self, task: Task) -> str:
        textworld = _textworld()
        self.close()
        self.game_path = resolve_game(task, self.game_key, self.games_dir, (GAME_SUFFIX,),
                                      "TextWorldEnv", "a TextWorld game file")
        if not self.game_path.with_suffix(".json").is_file():
            raise FileNotFoundError(
                f"task.metadata[{self.game_key!r}]: {self.game_path} has no "
                f"{self.game_path.with_suffix('.json').name} beside it (TextWorld tracks the game "
                f"with it; task {task.task_id}); regenerate the game with make_games")
        infos = textworld.EnvInfos(admissible_commands=True, score=True, max_score=True,
                                   won=True, lost=True, moves=True)
        with _LOAD_LOCK:
            self.env = textworld.start(str(self.game_path), request_infos=infos)
            state = self.env.reset()
        self._reset_counters()
        self.max_score = int(state["max_score"] or 0)
        self.admissible = set(state["admissible_commands"] or [])
        return clean_observation(state.feedback, self.max_intro_chars)

    def step(self, action: str) -> tuple[str, float, bool]:
        command, _ = self._command(action)
        state, score, done = self.env.step(command)
        gained = int(score or 0) - self.score
        self.score = int(score or 0)
        self.won, self.lost = bool(state["won"]), bool(state["lost"])
        self.moves = int(state["moves"] or 0)
        self.done = bool(done or self.won or self.lost)
        self.admissible = set(state["admissible_commands"] or [])
        observation = clean_observation(state.feedback, self.max_obs_chars)
        return observation, self._reward(gained), self.done

    def _reward(self, gained: int) -> float:
        if self.reward_mode == "win":
            return 1.0 if self.won else 0.0
        if self.reward_mode == "normalized":
            return gained / self.max_score if self.max_score else 0.0
        return float(gained)

    def metrics(self) -> dict:
        """This episode's outcome, for the sample's metadata."""
        return {"won": self.won, "lost": self.lost, "score": self.score,
                "max_score": self.max_score, "moves": self.moves,
                "invalid_actions": self.invalid}
