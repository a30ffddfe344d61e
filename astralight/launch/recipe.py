"""Reading a recipe: its ``extends`` chain merged, its ``pythonpath`` resolved, its keys checked.

A recipe is one YAML holding every component's config of a run (``astralight run RECIPE.yaml``,
:mod:`astralight.launch`). This module turns the file into the mapping the launcher reads, and
refuses a recipe that cannot work before anything starts, naming the key and the fix
(:class:`RecipeError`). It imports no component: reading a recipe is cheap.

Inheritance: ``extends: PATH`` (relative to the folder of the file that says it) names a parent
recipe; the child is laid over it by :func:`deep_merge`:

- mappings merge key by key;
- a list in the child replaces the parent's list (so a variant can shorten a list as well as
  extend it; ``configs/toy/autoscale.yaml`` restates ``raas`` this way);
- a **mapping laid over a list** changes entries of the parent's list in place: an int key picks
  an entry by index (``raas: {0: {max_concurrency: 16}}``), a string key the entry whose
  ``model_id`` is that string -- a trainer's ``model.init_args.model_id``, or a ``model_id`` key
  of the entry (``trainers: {policy: {model: {init_args: {lr: 1.0e-4}}}}``). Each picked entry
  is deep-merged with the same rules; the others are kept as they are. A key that picks nothing
  is an error naming it and the choices;
- anything else replaces.

Plugin modules: ``pythonpath: [DIR, ...]`` (relative to the folder of the recipe that says it)
is put on the launcher's ``sys.path`` (which imports ``prepare`` functions) and in front of the
``PYTHONPATH`` of every component (dataflow, RaaS, autoscaler and its instances, trainers), so
one setting makes a module importable everywhere.

Placeholders (:func:`substitute`), filled by the launcher in every string value: ``{run_dir}``,
``{dataflow_url}``, ``{init_model}`` (what the ``prepare`` step built), ``{seed}``.

Keys and types: :mod:`astralight.launch.recipe_schema` (dataclasses, checked with jsonargparse).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from astralight.launch.supervise import SuperviseError, supervise_settings


class RecipeError(ValueError):
    """The recipe is not usable; the message names the key and the fix."""


def substitute(obj: Any, values: dict[str, Any]) -> Any:
    """``obj`` with every ``{key}`` of ``values`` replaced in every string, at any depth."""
    if isinstance(obj, str):
        for key, value in values.items():
            obj = obj.replace("{" + key + "}", str(value))
        return obj
    if isinstance(obj, dict):
        return {k: substitute(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [substitute(v, values) for v in obj]
    return obj


def entry_id(entry: Any) -> str | None:
    """The ``model_id`` a list entry is picked by when a mapping is merged over its list: a
    trainer config's ``model.init_args.model_id``, else the entry's own ``model_id`` key."""
    if not isinstance(entry, dict):
        return None
    model = entry.get("model")
    init_args = model.get("init_args") if isinstance(model, dict) else None
    if isinstance(init_args, dict) and isinstance(init_args.get("model_id"), str):
        return init_args["model_id"]
    return entry["model_id"] if isinstance(entry.get("model_id"), str) else None


def _merge_into_list(parent: list, child: dict, where: str) -> list:
    """The parent's list with the entries the child's keys pick deep-merged (see the module
    docstring); raises RecipeError naming ``where.key`` when a key picks nothing."""
    out = copy.deepcopy(parent)
    ids = [entry_id(entry) for entry in parent]
    for key, changes in child.items():
        if isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(parent):
                raise RecipeError(
                    f"{where}.{key}: the parent recipe's {where.rsplit('.', 1)[-1]} has "
                    f"{len(parent)} entr{'y' if len(parent) == 1 else 'ies'} (index 0.."
                    f"{len(parent) - 1}); to add an entry restate the whole list")
            index = key
        elif isinstance(key, str):
            matches = [i for i, found in enumerate(ids) if found == key]
            if len(matches) != 1:
                known = [i for i in ids if i is not None]
                why = "no entry" if not matches else f"{len(matches)} entries"
                raise RecipeError(
                    f"{where}.{key}: {why} of the parent recipe's list has model_id {key!r} "
                    f"(model_ids: {known or 'none'}); pick an entry by its model_id or by its "
                    f"index (an unquoted int), or restate the whole list")
            index = matches[0]
        else:
            raise RecipeError(f"{where}.{key}: pick a list entry by index (int) or model_id "
                              f"(string), got {key!r}")
        out[index] = deep_merge(parent[index], changes, f"{where}.{key}")
    return out


def deep_merge(parent: Any, child: Any, where: str = "recipe") -> Any:
    """``child`` laid over ``parent``: mappings merge key by key, a mapping over a list changes
    the entries it picks (by index or model_id), anything else -- lists included -- replaces.

    ``where`` names the position in errors (``recipe.trainers.policy``). Neither input is
    modified.
    """
    if isinstance(parent, dict) and isinstance(child, dict):
        out = copy.deepcopy(parent)
        for key, value in child.items():
            out[key] = (deep_merge(parent[key], value, f"{where}.{key}") if key in parent
                        else copy.deepcopy(value))
        return out
    if isinstance(parent, list) and isinstance(child, dict):
        return _merge_into_list(parent, child, where)
    return copy.deepcopy(child)


def read_recipe_file(path: Path) -> dict:
    """One recipe file's mapping (no ``extends`` followed); RecipeError if unreadable."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise RecipeError(f"recipe: cannot read {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe: {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: {path} must hold a mapping")
    return data


def _resolve_pythonpath(recipe: dict, path: Path) -> None:
    """``recipe["pythonpath"]`` made absolute against the folder of ``path`` (in place), so that
    a parent's entries stay relative to the parent's own folder once merged."""
    if "pythonpath" not in recipe or recipe["pythonpath"] is None:
        return
    entries = recipe["pythonpath"]
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        raise RecipeError(f"recipe.pythonpath: in {path} must be a list of folders (relative to "
                          f"{path.parent}), e.g. [.] or [plugins], got {recipe['pythonpath']!r}")
    folder = path.resolve().parent
    recipe["pythonpath"] = [str((folder / os.path.expanduser(e)).resolve()) for e in entries]


def resolve_recipe(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """Read a recipe and the chain of recipes it ``extends``, merged, without ``extends``.

    ``extends`` is relative to the folder of the file that says it, and so is each file's
    ``pythonpath`` (made absolute here). A missing parent or a cycle raises RecipeError naming
    ``recipe.extends`` and the file.
    """
    path = Path(path)
    resolved = path.resolve()
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, resolved))
        raise RecipeError(f"recipe.extends: cycle of recipes {cycle}; remove one of the extends")
    recipe = read_recipe_file(path)
    _resolve_pythonpath(recipe, path)
    parent_ref = recipe.pop("extends", None)
    if parent_ref is None:
        return recipe
    if not isinstance(parent_ref, str) or not parent_ref:
        raise RecipeError(f"recipe.extends: in {path} must be a path (relative to {path.parent}), "
                          f"got {parent_ref!r}")
    parent_path = Path(parent_ref)
    if not parent_path.is_absolute():
        parent_path = resolved.parent / parent_path
    if not parent_path.is_file():
        raise RecipeError(f"recipe.extends: {parent_ref!r} in {path} names {parent_path}, "
                          f"which does not exist (the path is relative to the recipe's folder)")
    return deep_merge(resolve_recipe(parent_path, (*_chain, resolved)), recipe)


def set_key(recipe: dict, dotted: str, value: str) -> None:
    """``recipe[a][b][0][c] = value`` for ``dotted = "a.b.0.c"``, the value read as YAML (``1e-3``
    as a number too); missing mapping keys are made (the schema then names a misspelt one), a
    list item must exist. RecipeError naming ``--set`` and the key otherwise."""
    parsed = yaml.safe_load(value) if value.strip() else ""
    if isinstance(parsed, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            parsed = float(parsed)
        except ValueError:
            pass
    parts = dotted.split(".")
    if not dotted or any(not part for part in parts):
        raise RecipeError(f"--set {dotted}={value}: the key must be a dotted path such as "
                          "trainers.0.model.init_args.lr")
    node: Any = recipe
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth]) or "the recipe"
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"--set {dotted}: {here} is a list of {len(node)} item(s); "
                                  f"{part!r} is not an index of it")
            if last:
                node[int(part)] = parsed
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = parsed
            else:
                node = node.setdefault(part, {})
        else:
            raise RecipeError(f"--set {dotted}: {here} is {type(node).__name__} {node!r}, not a "
                              "mapping or a list")


def apply_overrides(recipe: dict, items: list[str]) -> dict:
    """``recipe`` with each ``KEY=VALUE`` of ``items`` set in order (:func:`set_key`)."""
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise RecipeError(f"--set {item}: expected KEY=VALUE, e.g. stop.versions=10")
        set_key(recipe, key.strip(), value)
    return recipe


def load_recipe(path: Path) -> dict:
    """Read and check a recipe (its ``extends`` chain merged); every problem names its key.

    Checked here, in milliseconds and importing no component: every key and type
    (:func:`astralight.launch.recipe_schema.validate_recipe`), ``supervise`` and ``autoscale``.
    ``stop.versions`` need not be a multiple of ``dataflow.eval.every``: every stop evaluates
    the last version (:mod:`astralight.launch.stop`). ``stop.versions`` may be left to be derived from the trainer's
    ``max_steps`` (:func:`astralight.launch.stop.resolve_versions`, which the launcher and
    :func:`astralight.launch.check.check_recipe` apply); the recipe is returned as written. The
    component configs themselves are checked by :func:`astralight.launch.check.check_recipe`
    (``astralight run --check``).
    """
    from astralight.launch.recipe_schema import SchemaError, validate_recipe

    recipe = resolve_recipe(Path(path))
    try:
        validate_recipe(recipe)
    except SchemaError as exc:
        raise RecipeError(f"{exc} (in {path})") from None
    if not recipe["raas"]:
        raise RecipeError("recipe.raas: must be a non-empty list of RaaS configs")
    if not recipe["trainers"]:
        raise RecipeError("recipe.trainers: must be a non-empty list of trainer configs")
    versions = recipe["stop"].get("versions")
    if versions is not None and (isinstance(versions, bool) or not isinstance(versions, int)):
        raise RecipeError("recipe.stop.versions: must be a positive int (policy versions to train)")
    supervise_settings_checked(recipe.get("supervise"))
    if recipe.get("autoscale") is not None:
        autoscale_settings(recipe["autoscale"])
    return recipe


def _autoscale_defaults() -> dict:
    from astralight.launch.recipe_schema import AutoscaleSection

    return {f.name: f.default for f in dataclasses.fields(AutoscaleSection)}


#: recipe.autoscale keys and their defaults (the autoscaler's flags, see astralight.autoscale;
#: declared in :class:`astralight.launch.recipe_schema.AutoscaleSection`)
AUTOSCALE_DEFAULTS = _autoscale_defaults()


def autoscale_settings(spec: Any) -> dict:
    """``recipe.autoscale`` with defaults filled in, checked; problems name the key."""
    if not isinstance(spec, dict):
        raise RecipeError("recipe.autoscale: must be a mapping, e.g. {min_instances: 1, "
                          "max_instances: 3, every: 5}")
    unknown = sorted(set(spec) - set(AUTOSCALE_DEFAULTS))
    if unknown:
        raise RecipeError(f"recipe.autoscale.{unknown[0]}: unknown key; known: "
                          f"{', '.join(AUTOSCALE_DEFAULTS)}")
    out = {**AUTOSCALE_DEFAULTS, **spec}
    for key in ("min_instances", "max_instances", "every"):
        if isinstance(out[key], bool) or not isinstance(out[key], int):
            raise RecipeError(f"recipe.autoscale.{key}: must be an int, got {out[key]!r}")
    for key in ("cooldown_s", "poll_s", "drain_timeout_s", "kill_after_s", "replace_backoff_s"):
        if isinstance(out[key], bool) or not isinstance(out[key], (int, float)) or out[key] < 0:
            raise RecipeError(f"recipe.autoscale.{key}: must be a number of seconds >= 0, "
                              f"got {out[key]!r}")
    if out["poll_s"] == 0:
        raise RecipeError("recipe.autoscale.poll_s: must be > 0 seconds")
    if out["every"] < 1:
        raise RecipeError(f"recipe.autoscale.every: must be >= 1 versions, got {out['every']}")
    if out["min_instances"] < 0:
        raise RecipeError(f"recipe.autoscale.min_instances: must be >= 0, got {out['min_instances']}")
    if out["max_instances"] < max(out["min_instances"], 1):
        raise RecipeError(f"recipe.autoscale.max_instances: must be >= min_instances "
                          f"({out['min_instances']}) and >= 1, got {out['max_instances']}")
    initial = out["initial"]
    if initial is not None and (isinstance(initial, bool) or not isinstance(initial, int)
                                or not out["min_instances"] <= initial <= out["max_instances"]):
        raise RecipeError(f"recipe.autoscale.initial: must be an int within min_instances.."
                          f"max_instances ({out['min_instances']}..{out['max_instances']}), "
                          f"got {initial!r}")
    return out


def supervise_settings_checked(spec: Any) -> dict | None:
    """:func:`astralight.launch.supervise.supervise_settings`, its errors as :class:`RecipeError`."""
    try:
        return supervise_settings(spec)
    except SuperviseError as exc:
        raise RecipeError(str(exc)) from None


def recipe_pythonpath(recipe: dict) -> list[str]:
    """The recipe's ``pythonpath`` folders (absolute once read by :func:`resolve_recipe`)."""
    return [str(p) for p in recipe.get("pythonpath") or []]


def use_pythonpath(recipe: dict) -> list[str]:
    """Put the recipe's ``pythonpath`` in front of this process's ``sys.path`` (the launcher
    imports ``prepare`` functions itself); returns the folders added."""
    added = [p for p in recipe_pythonpath(recipe) if p not in sys.path]
    sys.path[:0] = added
    return added


def with_pythonpath(recipe: dict, env: dict) -> dict:
    """A component's ``env`` mapping with the recipe's ``pythonpath`` in front of its
    ``PYTHONPATH`` (its own ``env.<kind>.PYTHONPATH``, else the launcher's); ``env`` itself
    when the recipe has no ``pythonpath``. ``env`` is not modified."""
    folders = recipe_pythonpath(recipe)
    if not folders:
        return env
    current = str(env.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")) or "")
    return {**env, "PYTHONPATH": os.pathsep.join(
        folders + [p for p in current.split(os.pathsep) if p])}


__all__ = ["RecipeError", "set_key", "apply_overrides", "substitute", "entry_id", "deep_merge", "read_recipe_file",
           "resolve_recipe", "load_recipe", "AUTOSCALE_DEFAULTS", "autoscale_settings",
           "supervise_settings_checked", "recipe_pythonpath", "use_pythonpath", "with_pythonpath"]
