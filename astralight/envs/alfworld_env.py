"""ALFWorld's text games as an astralight :class:`~astralight.workflows.multi_turn.Environment`.

An ALFWorld game is a folder with ``game.tw-pddl`` (JSON: the PDDL domain, the text grammar with
the task filled in, the PDDL problem, ``solvable`` and the expert ``walkthrough``) and
``traj_data.json`` (the ALFRED trajectory: ``task_type``, ``pddl_params``, annotations). The games
are played exactly as ALFWorld's own ``AlfredTWEnv`` plays them: TextWorld's ``PddlEnv`` wrapped
in ALFWorld's ``AlfredDemangler`` (``Apple_bar__plus_00_dot_10...`` -> ``apple 1``) and
``AlfredInfos``; the reward is ALFWorld's: 1.0 on the step that completes the task, else 0.0.

What it needs, beyond ``textworld``: ``alfworld`` (a pure-Python wheel; ``pip install
alfworld``) and TextWorld's PDDL engine, ``fast_downward`` (``pip install "textworld[pddl]"``,
the ``fast-downward-textworld`` package: a source distribution that compiles Fast Downward's
C++ library, so it needs cmake and a C++ compiler and takes minutes). ALFWorld's game data
(``alfworld-download``) is not needed for local games. Without these, :meth:`AlfWorldEnv.reset`
raises an ImportError saying what to install; the prompt source (:class:`AlfWorldGames`) only
reads JSON and works without them.

Observations are cleaned like TextWorld's (:func:`astralight.envs.text.clean_observation`):
the ``-= Welcome to TextWorld, ALFRED! =-`` line is dropped, and with ``task_first`` the
``Your task is to: ...`` line (last in ALFWorld's opening text, after the list of every
receptacle in the room) moves to the front, so that capping a long room never cuts the task.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from astralight.envs.text import clean_observation
from astralight.envs.textworld_env import TextGameEnv, resolve_game
from astralight.protocol import Task
from astralight.tasks.base import Prompt, PromptSource, check_index

log = logging.getLogger(__name__)

GAME_FILE = "game.tw-pddl"
TRAJ_FILE = "traj_data.json"
#: ALFWorld's six task types (``alfworld.agents.environment.alfred_tw_env.TASK_TYPES``)
TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep",
              "pick_two_obj_and_place")
_WELCOME = re.compile(r"^-= Welcome to TextWorld, ALFRED! =-$")
_TASK = re.compile(r'Your task is to: ([^"\n]+)')
_INSTALL = ('ALFWorld games need TextWorld\'s PDDL engine and ALFWorld\'s wrappers: pip install '
            '"textworld[pddl]" alfworld (fast-downward-textworld builds Fast Downward from C++ '
            'source: it needs cmake and g++)')


def _alfworld_stack():
    """``(textworld, PddlEnv, AlfredDemangler, AlfredInfos)``, or ImportError naming the fix."""
    try:
        import fast_downward  # noqa: F401 - PddlEnv needs it and says so only when built
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from textworld.envs import PddlEnv
    except ImportError as exc:
        raise ImportError(f"{_INSTALL} ({exc})") from None
    return textworld, PddlEnv, AlfredDemangler, AlfredInfos


def task_description(grammar: str) -> str:
    """The task an ALFWorld grammar announces (``Your task is to: X.`` -> ``X``), or ""."""
    m = _TASK.search(grammar.replace("\\n", "\n"))
    return m.group(1).strip().rstrip(".") if m else ""


def opening_text(feedback: str, task_first: bool) -> str:
    """ALFWorld's opening text without its welcome line, the task line first if asked."""
    lines = [ln for ln in feedback.splitlines() if not _WELCOME.match(ln.strip())]
    if task_first:
        task = [ln for ln in lines if ln.strip().startswith("Your task is to:")]
        lines = task + [ln for ln in lines if ln not in task]
    return "\n".join(lines)


class AlfWorldEnv(TextGameEnv):
    """One episode of an ALFWorld game (see the module doc).

    Args:
        game_key: the task metadata field with the game (its folder or its ``game.tw-pddl``).
        games_dir: where relative game paths are (None: the working directory).
        max_obs_chars: most characters of a step's observation.
        max_intro_chars: most characters of the first observation.
        task_first: put the task sentence first in the opening observation.
        shuffle_names: ALFWorld's domain randomisation (``AlfredDemangler(shuffle=True)``):
            object numbers assigned in a random order.
        max_action_chars: a longer command is cut.
    """

    def __init__(self, game_key: str = "game", games_dir: str | None = None,
                 max_obs_chars: int = 300, max_intro_chars: int = 600, task_first: bool = True,
                 shuffle_names: bool = False, max_action_chars: int = 200):
        for name, value in (("max_obs_chars", max_obs_chars), ("max_intro_chars", max_intro_chars),
                            ("max_action_chars", max_action_chars)):
            if int(value) < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        self.game_key, self.games_dir = game_key, games_dir
        self.max_obs_chars, self.max_intro_chars = int(max_obs_chars), int(max_intro_chars)
        self.task_first, self.shuffle_names = task_first, shuffle_names
        self.max_action_chars = int(max_action_chars)
        self.env: Any = None
        self.game_path: Path | None = None
        self.won = self.done = False
        self.moves = self.invalid = 0
        self.admissible: set[str] = set()

    def _game_path(self, task: Task) -> Path:
        return resolve_game(task, self.game_key, self.games_dir, (".tw-pddl",), "AlfWorldEnv",
                            f"an ALFWorld game (a folder with {GAME_FILE}, or the file)",
                            file_in_folder=GAME_FILE)

    def reset(self, task: Task) -> str:
        path = self._game_path(task)
        textworld, PddlEnv, AlfredDemangler, AlfredInfos = _alfworld_stack()
        self.close()
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        env = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=self.shuffle_names))
        try:
            env.load(str(path))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"task.metadata[{self.game_key!r}]: {path} is not an ALFWorld game "
                             f"(needs pddl_domain, grammar and pddl_problem: {exc}; task "
                             f"{task.task_id})") from None
        self.env, self.game_path = env, path
        state = env.reset()
        self.won = self.done = False
        self.moves = self.invalid = 0
        self.admissible = set(state["admissible_commands"] or [])
        opening = opening_text(state.feedback, self.task_first)
        return clean_observation(opening, self.max_intro_chars)

    def step(self, action: str) -> tuple[str, float, bool]:
        command, admissible = self._command(action)
        self.moves += admissible
        state, score, done = self.env.step(command)
        was_won, self.won = self.won, bool(state["won"])
        self.done = bool(done or self.won)
        self.admissible = set(state["admissible_commands"] or [])
        reward = 1.0 if self.won and not was_won else 0.0
        return clean_observation(state.feedback, self.max_obs_chars), reward, self.done

    def metrics(self) -> dict:
        """This episode's outcome, for the sample's metadata."""
        return {"won": self.won, "moves": self.moves, "invalid_actions": self.invalid}


class AlfWorldGames(PromptSource):
    """The ALFWorld games under ``games_dir`` as prompts, chosen as ALFWorld's ``AlfredTWEnv``
    chooses them: every folder with ``traj_data.json`` and a solvable ``game.tw-pddl``, of one
    of ``task_types``, except ``movable`` and ``Sliced`` ones (ALFWorld does not support them).

    ALFWorld's splits are folders (``train``, ``valid_seen``, ``valid_unseen``): point a train
    source and an eval source at two of them. Prompt ids are the game folders relative to
    ``games_dir``; the prompt is the task description; metadata ``{"game": folder,
    "task_type": ..., "walkthrough": [...]}``.

    Args:
        games_dir: the folder to search (recursively).
        task_types: the task types to keep (default: all six).
        max_games: keep the first ``max_games`` (sorted by folder; 0: all).
    """

    def __init__(self, games_dir: str, task_types: list[str] | None = None, max_games: int = 0):
        root = Path(os.path.expandvars(str(games_dir))).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"games_dir: {root} is not a folder of ALFWorld games")
        kinds = list(task_types or TASK_TYPES)
        unknown = sorted(set(kinds) - set(TASK_TYPES))
        if unknown:
            raise ValueError(f"task_types: unknown {unknown}; ALFWorld's are {list(TASK_TYPES)}")
        if max_games < 0:
            raise ValueError(f"max_games: must be >= 0, got {max_games}")
        self.games_dir, self.task_types = root, kinds
        self.skipped: dict[str, int] = {"unsupported": 0, "task_type": 0, "no_game": 0,
                                        "unsolvable": 0}
        self.items: list[tuple[str, str, dict]] = []
        for traj in sorted(root.rglob(TRAJ_FILE)):
            item = self._item(traj.parent)
            if item is not None:
                self.items.append(item)
        if max_games:
            self.items = self.items[:max_games]
        if not self.items:
            raise ValueError(f"games_dir: no playable ALFWorld games in {root} (skipped "
                             f"{self.skipped}); each needs {TRAJ_FILE} and a solvable {GAME_FILE}")

    def _item(self, folder: Path) -> tuple[str, str, dict] | None:
        rel = folder.relative_to(self.games_dir).as_posix()
        if "movable" in rel or "Sliced" in rel:
            self.skipped["unsupported"] += 1
            return None
        traj = json.loads((folder / TRAJ_FILE).read_text())
        if traj.get("task_type") not in self.task_types:
            self.skipped["task_type"] += 1
            return None
        if not (folder / GAME_FILE).is_file():
            self.skipped["no_game"] += 1
            return None
        game = json.loads((folder / GAME_FILE).read_text())
        if not game.get("solvable"):
            self.skipped["unsolvable"] += 1
            return None
        metadata = {"game": str(folder), "task_type": traj["task_type"],
                    "walkthrough": [str(c) for c in (game.get("walkthrough") or [])]}
        return rel, task_description(str(game.get("grammar", ""))) or rel, metadata

    def __len__(self) -> int:
        return len(self.items)

    def get(self, index: int) -> Prompt:
        prompt_id, prompt, metadata = self.items[check_index(index, len(self.items), "game",
                                                             self.games_dir)]
        return Prompt(prompt_id=prompt_id, prompt=prompt, metadata=dict(metadata,
                      walkthrough=list(metadata["walkthrough"])))
