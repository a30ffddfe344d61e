"""Shared base and types of the dataflow's data plugins (curators, filters, replay selectors).

AstraFlow makes data algorithms plug-ins of the dataflow layer at three points: before rollout
(prompt curators), after rollout (sample filters) and at batch serving (replay selectors), plus
the order of the fresh queue. Every plugin is a plain class named in the dataflow YAML by import
path (``{class_path, init_args}``, architecture rule 6); ``BUILT_INS`` gives the built-ins short
names, per hook, so a recipe can say ``curators: [greso]``. ``normalize_spec`` turns either form
into the full ``{class_path, init_args}`` dict that jsonargparse instantiates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: The one registry of built-in plugins: short name -> import path, per hook (the config key that
#: lists that hook's plugins). A short name is valid only for its own hook.
BUILT_INS: dict[str, dict[str, str]] = {
    "curators": {  # prompt curators (pre-rollout)
        "accept_all": "astralight.dataflow.curators.AcceptAll",
        "filter_solved": "astralight.dataflow.curators.FilterSolved",
        "greso": "astralight.dataflow.curators.GRESO",
    },
    "sample_filters": {  # sample filters (post-rollout)
        "keep_all": "astralight.dataflow.sample_filters.KeepAll",
        "zero_advantage": "astralight.dataflow.sample_filters.ZeroAdvantage",
        "length": "astralight.dataflow.sample_filters.LengthFilter",
    },
    "replay.selectors": {  # replay selectors (serving)
        "latest": "astralight.dataflow.replay.Latest",
        "uniform": "astralight.dataflow.replay.Uniform",
        "high_variance": "astralight.dataflow.replay.HighVariance",
    },
    "queue_order": {  # fresh-queue orders
        "fifo": "astralight.dataflow.queues.Fifo",
        "edf": "astralight.dataflow.queues.Edf",
        "freshest": "astralight.dataflow.queues.Freshest",
    },
}

#: every short name of every hook -> import path (short names are unique across hooks)
ALIASES: dict[str, str] = {short: path for names in BUILT_INS.values() for short, path in names.items()}


def hook_of(name: str) -> str | None:
    """The hook a config location such as ``"curators[1]"`` or ``"queue_order.policy[0]"``
    belongs to, or None when it names none (then every hook's short names are accepted)."""
    for hook in BUILT_INS:
        if name == hook or name.startswith((hook + "[", hook + ".")):
            return hook
    return None


def short_names(name: str) -> dict[str, str]:
    """The short names valid at the config location ``name`` (see :func:`hook_of`)."""
    hook = hook_of(name)
    return ALIASES if hook is None else BUILT_INS[hook]


def _forms(name: str) -> str:
    return ("accepted forms: a short name (" + ", ".join(sorted(short_names(name))) + "), a full "
            "import path 'package.module.Class', or {class_path: <name or import path>, "
            "init_args: {...}}")


def _resolve(path: object, name: str) -> str:
    names = short_names(name)
    if isinstance(path, str) and path in names:
        return names[path]
    if isinstance(path, str) and "." in path and all(p.isidentifier() for p in path.split(".")):
        return path
    raise ValueError(f"{name}: unknown plugin {path!r}; {_forms(name)}")


def normalize_spec(spec: str | dict, name: str) -> dict:
    """Return ``{"class_path": <import path>, "init_args": {...}}`` for a plugin spec from YAML.

    ``name`` locates the spec in the config (e.g. ``"curators[1]"``) and so says which hook's
    short names apply; a typo fails at start-up with a message that says where it is and what
    that hook would have accepted. The class itself is
    not imported here: the service builds it (and checks its base class) with jsonargparse.
    """
    if isinstance(spec, str):
        return {"class_path": _resolve(spec, name), "init_args": {}}
    if isinstance(spec, dict):
        extra = set(spec) - {"class_path", "init_args"}
        if "class_path" not in spec or extra:
            what = f"unexpected keys {sorted(extra)}" if extra else "missing class_path"
            raise ValueError(f"{name}: {what}; {_forms(name)}")
        init_args = spec.get("init_args") or {}
        if not isinstance(init_args, dict):
            raise ValueError(f"{name}.init_args: must be a mapping of argument -> value, "
                             f"got {type(init_args).__name__}")
        return {"class_path": _resolve(spec["class_path"], name), "init_args": dict(init_args)}
    raise ValueError(f"{name}: got {type(spec).__name__} {spec!r}; {_forms(name)}")


@dataclass
class PromptOutcome:
    """What a curator learns once a train task's samples arrive.

    ``rewards`` holds every pushed sample's reward, per policy, BEFORE the sample filters run:
    a curator judges the prompt (is it solved? zero-variance?), not what the trainer got.
    ``kept`` says whether each policy's group survived the filters.
    """

    prompt_id: str
    prompt_index: int
    version: int
    rewards: dict[str, list[float]] = field(default_factory=dict)
    kept: dict[str, bool] = field(default_factory=dict)

    def groups(self, model_id: str | None) -> list[list[float]]:
        """Reward groups a curator with ``model_id`` looks at: all non-empty ones when None, else
        only that policy's (``[]`` when the outcome lacks it: the curator ignores the outcome)."""
        if model_id is None:
            return [list(g) for g in self.rewards.values() if len(g)]
        group = self.rewards.get(model_id)
        return [list(group)] if group else []


class DataPlugin:
    """Base of every data plugin. The service gives each plugin its own seeded generator
    (``plugin.rng = np.random.default_rng(...)``) before first use and persists
    ``rng.bit_generator.state`` itself; subclasses persist only their own state.

    Subclasses must call ``super().__init__()``.
    """

    def __init__(self) -> None:
        # A default so a plugin used alone (tests, notebooks) is still deterministic.
        self.rng: np.random.Generator = np.random.default_rng(0)

    def state_dict(self) -> dict:
        """JSON-able state (string keys) that ``load_state_dict`` restores after a restart."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        """Gauges shown in ``/v1/stats`` and TensorBoard (e.g. GRESO's ``p_easy``)."""
        return {}


def check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False,
                hi_open: bool = False) -> float:
    """Raise ValueError naming ``name`` and the valid range unless ``lo <(=) value <(=) hi``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo)
    ok = ok and (value < hi if hi_open else value <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name}: must be a number in {rng}, got {value!r}")
    return float(value)
