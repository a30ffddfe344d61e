"""The typed schema of a recipe (``astralight run RECIPE.yaml``): one dataclass per section.

Why dataclasses: jsonargparse (already the components' config parser) validates a value against a
dataclass -- every key known, every value of its type -- so the recipe is checked by the same
machinery as the dataflow, RaaS and trainer configs, not by a second, hand-written config language.
The component sections (``dataflow``, each ``raas`` entry, each ``trainers`` entry) are plain
mappings here: their own parsers check them (``astralight run --check``, :mod:`astralight.launch.check`).

:func:`validate_recipe` refuses an unknown key naming it and the closest valid one
(``recipe.supervize: unknown key; did you mean 'supervise'?``), a missing required section, and a
value of the wrong type naming its key and what is expected (``recipe.stop.timeout_s: ...
expected: seconds, a number > 0 such as 900``). Range and cross-field rules (autoscale bounds,
supervise backoff, ``stop.versions`` a multiple of ``dataflow.eval.every``) stay with the code
that applies them (:mod:`astralight.launch.recipe`, :mod:`astralight.launch.supervise`).

Every key the launcher reads is declared here; adding one to the launcher means adding it here
(``tests/unit/test_recipe_schema.py`` loads every shipped recipe).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from jsonargparse.typing import (
    ClosedUnitInterval,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)

from astralight.launch.guard import GUARD_DEFAULTS
from astralight.launch.supervise import SUPERVISE_DEFAULTS


def _help(text: str) -> dict:
    return {"help": text}


def _component(text: str) -> dict:
    """A component's own config: only its shape (a mapping, a list of mappings) is checked
    here. jsonargparse would resolve the ``class_path`` entries inside it, importing the
    trainer's classes (Lightning: seconds); the component's parser checks them
    (:mod:`astralight.launch.check`)."""
    return {"help": text, "component": True}


@dataclass
class PrepareSection:
    """``prepare``: builds ``{init_model}`` once per run folder before anything starts."""

    function: str = field(metadata=_help("an import path such as "
                                         "astralight.tasks.warmstart.build_toy_policy"))
    kwargs: Optional[dict[str, Any]] = field(
        default=None, metadata=_help("keyword arguments of the function (besides out_dir)"))


@dataclass
class StopSection:
    """``stop``: when the run is over, and how long each wait may take."""

    versions: Optional[PositiveInt] = field(default=None, metadata=_help(
        "policy versions to train, an int >= 1 (default: derived from the trainer's max_steps; "
        "neither set with max_wall_s or the trainer's max_time: a time-only run)"))
    model_id: str = field(default="policy", metadata=_help("the policy whose versions count"))
    timeout_s: PositiveFloat = field(
        default=3600.0, metadata=_help("seconds, a number > 0 such as 900 (no units)"))
    final_eval_timeout_s: NonNegativeFloat = field(
        default=300.0, metadata=_help("seconds, a number >= 0 such as 180 (no units)"))
    progress_every_s: PositiveFloat = field(
        default=5.0, metadata=_help("seconds between progress lines, a number > 0"))
    max_wall_s: Optional[PositiveFloat] = field(
        default=None, metadata=_help("a wall-time budget in seconds, a number > 0 (no units)"))
    target_accuracy: Optional[ClosedUnitInterval] = field(
        default=None, metadata=_help("an eval accuracy in [0, 1] that ends the run"))


@dataclass
class SuperviseSection:
    """``supervise``: restarts of crashed components (``supervise: false`` turns them off)."""

    enabled: bool = field(default=True, metadata=_help("true or false"))
    max_restarts: NonNegativeInt = field(default=SUPERVISE_DEFAULTS["max_restarts"],
                                         metadata=_help("restarts per component, an int >= 0"))
    backoff_s: NonNegativeFloat = field(default=SUPERVISE_DEFAULTS["backoff_s"],
                                        metadata=_help("seconds, a number >= 0"))
    backoff_factor: PositiveFloat = field(default=SUPERVISE_DEFAULTS["backoff_factor"],
                                          metadata=_help("a number >= 1"))
    max_backoff_s: NonNegativeFloat = field(default=SUPERVISE_DEFAULTS["max_backoff_s"],
                                            metadata=_help("seconds, a number >= 0"))


@dataclass
class CpuAffinitySection:
    """``cpu_affinity``: CPUs per component kind (kept only where this machine has them)."""

    dataflow: Optional[list[int]] = field(default=None, metadata=_help("a list of CPU numbers"))
    raas: Optional[list[int]] = field(default=None, metadata=_help("a list of CPU numbers"))
    trainer: Optional[list[int]] = field(default=None, metadata=_help("a list of CPU numbers"))


#: environment variables: names to plain values (``OMP_NUM_THREADS: 1``)
EnvVars = dict[str, Union[str, int, float, bool]]


@dataclass
class EnvSection:
    """``env``: extra environment variables per component kind."""

    dataflow: Optional[EnvVars] = field(default=None, metadata=_help("{NAME: value}"))
    raas: Optional[EnvVars] = field(default=None, metadata=_help("{NAME: value}"))
    trainer: Optional[EnvVars] = field(default=None, metadata=_help("{NAME: value}"))


@dataclass
class AutoscaleSection:
    """``autoscale``: an elastic RaaS pool (``astralight autoscale``) instead of the ``raas``
    list; ``raas[0]`` is every instance's config. The defaults are the autoscaler's."""

    min_instances: int = field(default=1, metadata=_help("an int >= 0"))
    max_instances: int = field(default=4, metadata=_help("an int >= 1"))
    initial: Optional[int] = field(default=None, metadata=_help("an int in min..max"))
    cooldown_s: float = field(default=120.0, metadata=_help("seconds, a number >= 0"))
    every: int = field(default=10, metadata=_help("versions between decisions, an int >= 1"))
    poll_s: float = field(default=2.0, metadata=_help("seconds, a number > 0"))
    drain_timeout_s: float = field(default=60.0, metadata=_help("seconds, a number >= 0"))
    kill_after_s: float = field(default=30.0, metadata=_help("seconds, a number >= 0"))
    replace_backoff_s: float = field(default=10.0, metadata=_help("seconds, a number >= 0"))


@dataclass
class RayResources:
    """The Ray resources of one component kind's actor (``ray.raas``, ``ray.trainer``, ...)."""

    num_cpus: Optional[NonNegativeFloat] = field(default=None, metadata=_help("CPUs, a number >= 0"))
    num_gpus: Optional[NonNegativeFloat] = field(default=None, metadata=_help("GPUs, a number >= 0"))
    memory: Optional[NonNegativeInt] = field(default=None, metadata=_help("bytes, an int >= 0"))
    resources: Optional[dict[str, NonNegativeFloat]] = field(default=None, metadata=_help(
        "custom Ray resources {NAME: amount}"))


@dataclass
class RaySection:
    """``ray``: where ``astralight run --backend ray`` places the components
    (:mod:`astralight.launch.ray_launch`); read only with that backend."""

    address: Optional[str] = field(default=None, metadata=_help(
        "the Ray cluster, HOST:PORT (default: RAY_ADDRESS, or this machine's `ray start`)"))
    namespace: str = field(default="astralight", metadata=_help("the actors' Ray namespace"))
    strategy: str = field(default="PACK", metadata=_help(
        "the placement group's strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"))
    ready_timeout_s: PositiveFloat = field(default=300.0, metadata=_help(
        "seconds to wait for Ray to place the components, a number > 0"))
    dataflow: Optional[RayResources] = field(default=None, metadata=_help(
        "{num_cpus: 1} (the default; it runs on the launcher's node)"))
    raas: Optional[RayResources] = field(default=None, metadata=_help(
        "each RaaS's resources, default {num_gpus: 1, num_cpus: 1}"))
    trainer: Optional[RayResources] = field(default=None, metadata=_help(
        "each trainer's resources, default {num_gpus: 1, num_cpus: 1}"))
    autoscale: Optional[RayResources] = field(default=None, metadata=_help(
        "the autoscaler's resources, default {num_cpus: 0}"))


@dataclass
class BalanceSection:
    """``balance``: how often the dataflow's balance report is written to the run folder."""

    every: NonNegativeInt = field(default=10, metadata=_help("versions, an int >= 0 (0: never)"))


@dataclass
class GuardSection:
    """``guard``: the run guard (:mod:`astralight.launch.guard`); ``guard: false`` turns it off.
    A share or factor set to null turns that one check off."""

    enabled: bool = field(default=True, metadata=_help("true or false"))
    eval_drop: Optional[float] = field(default=GUARD_DEFAULTS["eval_drop"], metadata=_help(
        "a share of the best eval in (0, 1] such as 0.25, or null"))
    reward_drop: Optional[float] = field(default=GUARD_DEFAULTS["reward_drop"], metadata=_help(
        "a share of the best train reward in (0, 1] such as 0.5, or null"))
    length_factor: Optional[float] = field(default=GUARD_DEFAULTS["length_factor"],
                                           metadata=_help("a factor > 1 such as 4, or null"))
    malformed_rate: Optional[float] = field(default=GUARD_DEFAULTS["malformed_rate"],
                                            metadata=_help("a share in (0, 1] such as 0.5, or null"))
    entropy_floor: Optional[float] = field(default=GUARD_DEFAULTS["entropy_floor"],
                                           metadata=_help("nats per token > 0, or null (off)"))
    window: PositiveInt = field(default=GUARD_DEFAULTS["window"],
                                metadata=_help("train steps, an int >= 1 such as 10"))
    stop: bool = field(default=GUARD_DEFAULTS["stop"], metadata=_help(
        "true to stop the run at the first event, or false (warn only)"))


@dataclass
class Recipe:
    """A whole recipe, after its ``extends`` chain is merged (``extends`` itself is gone)."""

    dataflow: dict[str, Any] = field(metadata=_component("the dataflow service's config (a "
                                                         "mapping)"))
    raas: list[dict[str, Any]] = field(metadata=_component("a list of RaaS configs"))
    trainers: list[dict[str, Any]] = field(metadata=_component("a list of trainer (LightningCLI) "
                                                               "configs, one per policy"))
    stop: StopSection = field(metadata=_help("a mapping such as {versions: 150, timeout_s: 900}"))
    name: Optional[str] = field(default=None, metadata=_help("the run's name (a string)"))
    seed: int = field(default=0, metadata=_help("an int, the {seed} placeholder"))
    port: Optional[int] = field(default=None, metadata=_help("the dataflow's port, an int "
                                                             "(default: a free one)"))
    pythonpath: Optional[list[str]] = field(
        default=None, metadata=_help("folders (relative to the recipe's folder) put on sys.path "
                                     "of the launcher and PYTHONPATH of every component"))
    prepare: Optional[PrepareSection] = field(default=None, metadata=_help(
        "{function: pkg.module.func, kwargs: {...}}"))
    supervise: Optional[SuperviseSection] = field(default=None, metadata=_help(
        "a mapping such as {max_restarts: 3}, or false"))
    cpu_affinity: Optional[CpuAffinitySection] = field(default=None, metadata=_help(
        "{dataflow: [0], raas: [1], trainer: [0]}"))
    env: Optional[EnvSection] = field(default=None, metadata=_help(
        "{dataflow: {...}, raas: {...}, trainer: {...}}"))
    autoscale: Optional[AutoscaleSection] = field(default=None, metadata=_help(
        "a mapping such as {min_instances: 1, max_instances: 3}, or null"))
    balance: Optional[BalanceSection] = field(default=None, metadata=_help("{every: 10}"))
    ray: Optional[RaySection] = field(default=None, metadata=_help(
        "a mapping such as {address: HOST:PORT, raas: {num_gpus: 1}} (--backend ray)"))
    guard: Optional[GuardSection] = field(default=None, metadata=_help(
        "a mapping such as {eval_drop: 0.25, stop: true}, or false"))


class SchemaError(ValueError):
    """A recipe does not fit :class:`Recipe`; the message names the key (``recipe.stop.x``)."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section_class(tp: Any) -> type | None:
    """The dataclass in a field's type (``Optional[StopSection]`` -> StopSection), or None."""
    tp = _optional(tp)[0]
    return tp if dataclasses.is_dataclass(tp) else None


def _optional(tp: Any) -> tuple[Any, bool]:
    """``(type without None, whether None is allowed)``: ``Optional[X]`` -> ``(X, True)``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Union and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else Union[rest]), True
    return tp, False


_LEAF_PARSERS: dict[str, Any] = {}


def _check_leaf(value: Any, tp: Any, where: str, help_text: str | None) -> None:
    """One value against its type with jsonargparse (its coercions: ``"3"`` for an int passes)."""
    from jsonargparse import ArgumentError, ArgumentParser

    parser = _LEAF_PARSERS.get(repr(tp))
    if parser is None:
        parser = _LEAF_PARSERS[repr(tp)] = ArgumentParser(exit_on_error=False)
        parser.add_argument("--value", type=tp)
    try:
        parser.parse_object({"value": value})
    except (ArgumentError, TypeError, ValueError) as exc:
        message = str(exc)
        if "Union subtypes" in message:  # a list of every alternative's failure: say it plainly
            reason = f"got {value!r}"
        else:
            reason = " ".join(re.sub(r'^Parser key "value":', "", message.strip()).split())
        raise SchemaError(f"{where}: {reason}" + (f"; expected: {help_text}" if help_text else "")) \
            from None


def _check(value: Any, tp: Any, where: str, help_text: str | None) -> None:
    """``value`` against the field type ``tp``: sections recursively (unknown keys naming the
    closest known one, missing required keys), plain values with :func:`_check_leaf`."""
    tp, nullable = _optional(tp)
    if value is None:
        if nullable:
            return
        raise SchemaError(f"{where}: must not be null" + (f"; give {help_text}" if help_text else ""))
    if not dataclasses.is_dataclass(tp):
        _check_leaf(value, tp, where, help_text)
        return
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: must be a mapping, got {value!r}"
                          + (f"; expected: {help_text}" if help_text else ""))
    known = [f.name for f in dataclasses.fields(tp)]
    for key in value:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SchemaError(f"{where}.{key}: unknown key; {hint}the keys of {where} are "
                              f"{', '.join(known)}")
    hints = _hints(tp)
    for f in dataclasses.fields(tp):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name not in value:
            if required:
                raise SchemaError(f"{where}.{f.name}: missing; give "
                                  f"{f.metadata.get('help', 'it')}")
            continue
        if f.metadata.get("component"):
            _check_component(value[f.name], hints[f.name], f"{where}.{f.name}", f.metadata["help"])
        else:
            _check(value[f.name], hints[f.name], f"{where}.{f.name}", f.metadata.get("help"))


def _check_component(value: Any, tp: Any, where: str, help_text: str) -> None:
    """A component section's shape only: a mapping, or a list of mappings (see _component)."""
    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise SchemaError(f"{where}: must be a list, got {type(value).__name__}; expected: "
                              f"{help_text}")
        for i, entry in enumerate(value):
            if not isinstance(entry, dict):
                raise SchemaError(f"{where}[{i}]: must be a mapping (one component's config), "
                                  f"got {entry!r}")
    elif not isinstance(value, dict):
        raise SchemaError(f"{where}: must be a mapping, got {type(value).__name__}; expected: "
                          f"{help_text}")


def _field_help(key: str) -> str | None:
    """The help of the field at ``recipe.a.b`` (None when the path is not a field)."""
    parts = key.split(".")[1:]
    cls: type | None = Recipe
    meta = None
    for part in parts:
        if cls is None:
            return meta
        f = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if f is None:
            return meta
        meta = f.metadata.get("help")
        cls = _section_class(_hints(cls)[f.name])
    return meta


_PARSER = None


def _parser():
    """One jsonargparse parser holding the whole :class:`Recipe` (built once: ~50 ms)."""
    global _PARSER
    if _PARSER is None:
        from jsonargparse import ArgumentParser

        _PARSER = ArgumentParser(exit_on_error=False, prog="recipe")
        _PARSER.add_argument("--recipe", type=Recipe)
    return _PARSER


def _reason(message: str) -> tuple[str | None, str]:
    """``(key, reason)`` of a jsonargparse error message: its innermost ``Parser key "..."``,
    the one that names the value itself."""
    found = re.findall(r'Parser key "([^"]+)":\s*(.*?)(?=\n\s*\S.*Parser key|\Z)', message, re.S)
    if not found:
        return None, " ".join(message.split())
    key, reason = found[-1]
    return key, " ".join(reason.split())


def validate_recipe(recipe: dict) -> None:
    """Check a merged recipe against :class:`Recipe`; raise :class:`SchemaError` naming the key.

    The recipe itself is not changed and no defaults are filled in: the launcher reads the
    mapping as it is (the defaults above are the launcher's own, documented here).
    """
    if not isinstance(recipe, dict):
        raise SchemaError("recipe: must be a mapping of sections (dataflow, raas, trainers, stop)")
    for key in ("raas", "trainers"):
        if isinstance(recipe.get(key), dict):
            raise SchemaError(
                f"recipe.{key}: a mapping ({{model_id or index: changes}}) only merges into the "
                f"list of a parent recipe (`extends`); this recipe has none to merge into: give "
                f"a list")
    value = dict(recipe)
    for key in ("supervise", "guard"):  # `supervise: false` is {enabled: false}
        if isinstance(value.get(key), bool):
            value[key] = {"enabled": value[key]}
    _check(value, Recipe, "recipe", None)
    # the whole recipe once more, as jsonargparse parses a dataclass: the authority, should the
    # walk above ever miss something (its messages are the clearer ones)
    from jsonargparse import ArgumentError

    for f in dataclasses.fields(Recipe):  # component configs: shape checked above (_component)
        if f.metadata.get("component") and f.name in value:
            value[f.name] = [] if isinstance(value[f.name], list) else {}
    try:
        _parser().parse_object({"recipe": value})
    except (ArgumentError, TypeError, ValueError) as exc:
        key, reason = _reason(str(exc))
        key = key or "recipe"
        expected = _field_help(key)
        raise SchemaError(f"{key}: {reason}" + (f"; expected: {expected}" if expected else "")) \
            from None


__all__ = ["Recipe", "StopSection", "PrepareSection", "SuperviseSection", "CpuAffinitySection",
           "EnvSection", "AutoscaleSection", "BalanceSection", "RaySection", "RayResources", "GuardSection", "SchemaError",
           "validate_recipe"]
