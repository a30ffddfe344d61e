"""``astralight run --check RECIPE``: check a whole run before anything starts, in seconds.

Why: without it a mistake in a component config surfaces only after the warm start, the dataflow
and vLLM have started (a trainer typo such as ``max_step:`` reaches the trainer minutes in).
:func:`check_recipe` parses every component config with the component's own parser, the way the
component will, without starting or building anything heavy:

- the recipe itself: keys and types (:func:`astralight.launch.recipe.load_recipe`), ``stop.versions``
  against the trainers' ``max_steps`` (:func:`astralight.launch.stop.resolve_versions`), its
  ``pythonpath`` folders, the ``prepare`` function (importable; its ``kwargs`` are arguments it
  takes);
- the dataflow: :func:`astralight.dataflow.config.parse_config` (every field), its data plugins
  built (:func:`~astralight.dataflow.config.build_plugins`), its prompt sources checked against
  their class signatures (not instantiated: they would read their data);
- each RaaS: :func:`astralight.raas.config.build_parser` and
  :func:`~astralight.raas.config.validate` (engine arguments against the engine class, the
  workflow and its reward against their signatures; no engine is built and the workflow is not
  instantiated: it may read files the run writes first);
- each trainer: ``astralight fit --config F --print_config`` in this process (LightningCLI parses
  the trainer, callbacks, model and datamodule; nothing is instantiated);
- the token hand-off and CPU pinning of every component
  (as :func:`astralight.launch.build_components`);
- every local model or data path the configs name (``model_path``, ``tokenizer_path``, ``path``,
  ``files``, ``data_path``, ``data_dir``, ``corpus`` ... and the same keys of ``prepare.kwargs``).

Placeholders get plausible values: ``{run_dir}`` the run folder (a temporary one when not known
yet), ``{dataflow_url}`` ``http://127.0.0.1:PORT``, ``{seed}`` the recipe's. ``{init_model}`` is
what ``prepare`` builds: when it is not built yet it is a stand-in folder (so the parsers that
require an existing model folder accept it) and not an error; paths under the run folder are
written by the run (``prepare``) and not required either. A name such as ``Qwen/Qwen3-8B`` that
is no local folder is taken for a Hugging Face hub id and noted.

Every component config a component reads is checked here, each component kind with the
``PYTHONPATH`` it will have (the recipe's ``pythonpath`` and ``env.<kind>.PYTHONPATH``). A problem
raises :class:`~astralight.launch.recipe.RecipeError` naming the recipe key (``recipe.trainers[0].
trainer.max_step``) and the fix; ``astralight run`` runs the same check before it starts anything
(``--no-check`` skips the component part).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import io
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from astralight.launch.config_errors import explain, trainer_arguments
from astralight.launch.recipe import RecipeError, load_recipe, recipe_pythonpath, substitute, use_pythonpath

#: config keys whose values are local inputs (a model folder, a data file or folder) that must
#: exist before the run starts; outputs (``state_dir``, ``dirpath``, ``default_root_dir``,
#: ``save_dir``...) are not checked
MODEL_PATH_KEYS = ("model_path", "tokenizer_path", "base_model_path")
DATA_PATH_KEYS = ("path", "paths", "files", "data_path", "data_dir", "data_files", "corpus")


@dataclass
class CheckResult:
    """What a check looked at: component names, local paths found, notes (hub ids, models
    ``prepare`` will build), and how long it took."""

    recipe: str
    components: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        """The one-line OK."""
        return (f"OK: {self.recipe}: {len(self.components)} component configs "
                f"({', '.join(self.components)}) and {len(self.paths)} local paths checked in "
                f"{self.seconds:.1f}s")


@contextlib.contextmanager
def _sys_path(entries: list[str]) -> Iterator[None]:
    """``entries`` in front of ``sys.path`` for a while: the ``PYTHONPATH`` a component will have
    (relative entries resolve against the current folder, as in the child process)."""
    added = [str(Path(e).resolve()) for e in entries if e]
    saved = list(sys.path)
    sys.path[:0] = [a for a in added if a not in sys.path]
    try:
        yield
    finally:
        sys.path[:] = saved


@contextlib.contextmanager
def _captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def _error_line(text: str) -> str:
    """The ``error: ...`` line of an argparse / jsonargparse / LightningCLI failure (else its
    last line), without the usage lines around it."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("error:"):
            return " ".join([line[len("error:"):].strip()] + lines[i + 1:])
    return lines[-1] if lines else "(no message)"


def _kind_pythonpath(recipe: dict, kind: str) -> list[str]:
    """The folders a component of ``kind`` has on its ``PYTHONPATH`` besides the launcher's."""
    env = (recipe.get("env") or {}).get(kind) or {}
    own = str(env.get("PYTHONPATH") or "")
    return recipe_pythonpath(recipe) + [p for p in own.split(os.pathsep) if p]


# ------------------------------------------------------------------------------------ paths


def _walk_paths(node: Any, where: str, keys: tuple[str, ...], inside: str | None = None
                ) -> Iterator[tuple[str, str, str]]:
    """``(where, key kind, value)`` of every string under one of ``keys`` in ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            sub = f"{where}.{key}"
            kind = inside or (str(key) if str(key) in keys else None)
            yield from _walk_paths(value, sub, keys, kind)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk_paths(value, f"{where}[{i}]", keys, inside)
    elif isinstance(node, str) and inside is not None and node:
        yield where, inside, node


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _is_under(path: str, folder: Path | None) -> bool:
    if folder is None:
        return False
    try:
        Path(os.path.expanduser(path)).resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def _check_paths(node: Any, where: str, run_dir: Path, stand_in: Path | None,
                 result: CheckResult) -> None:
    """Every local input path under ``node`` exists, or is written by the run itself (under the
    run folder, or the init model ``prepare`` builds); raises RecipeError naming the key."""
    for key_path, kind, value in _walk_paths(node, where, MODEL_PATH_KEYS + DATA_PATH_KEYS):
        if "{" in value:  # a placeholder of a component's own (not the launcher's)
            continue
        if _is_under(value, stand_in):
            continue  # noted once, in check_recipe
        if _is_under(value, run_dir):
            result.notes.append(f"{key_path}: {value} is written by the run (under the run "
                                "folder), not checked")
            continue
        local = Path(os.path.expanduser(value))
        if local.exists():
            result.paths.append(value)
            continue
        model_key = kind in MODEL_PATH_KEYS
        if model_key and not value.startswith(("/", "./", "../", "~")) and _HUB_ID.match(value):
            result.notes.append(f"{key_path}: {value!r} is no local folder; taken for a Hugging "
                                "Face hub id")
            continue
        what = "model folder" if model_key else "data file or folder"
        raise RecipeError(
            f"{key_path}: {value!r} does not exist (a {what}; relative paths are relative to the "
            f"folder you run from, {Path.cwd()}); fix the path, or create it first"
            + ("" if model_key else "; a file the run's prepare step writes belongs under "
               "{run_dir}"))


# ------------------------------------------------------------------------------------ prepare


def _check_prepare(recipe: dict) -> Any:
    """The ``prepare`` function imported and its ``kwargs`` bound to its signature; returns the
    function (None without a prepare step)."""
    prep = recipe.get("prepare")
    if not prep:
        return None
    target = prep.get("function")
    if not isinstance(target, str) or "." not in target:
        raise RecipeError("recipe.prepare.function: must be an import path like pkg.module.func")
    module_name, func_name = target.rsplit(".", 1)
    import importlib

    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise RecipeError(f"recipe.prepare.function: cannot import {target!r} ({exc}); check the "
                          "module path, and that its folder is in the recipe's `pythonpath`") from None
    kwargs = prep.get("kwargs") or {}
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return func
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = [n for n in params if n != "out_dir"]
        for key in kwargs:
            if key not in params or key == "out_dir":
                close = difflib.get_close_matches(str(key), accepted, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise RecipeError(f"recipe.prepare.kwargs.{key}: {target} has no argument "
                                  f"{key!r} (out_dir is given by the launcher); {hint}it takes "
                                  f"{', '.join(accepted)}")
    for name, p in params.items():
        if (name != "out_dir" and p.default is inspect.Parameter.empty and name not in kwargs
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)):
            raise RecipeError(f"recipe.prepare.kwargs.{name}: missing; {target} requires it")
    return func


# ------------------------------------------------------------------------------------ components


def _check_dataflow(path: Path) -> None:
    from astralight.dataflow.config import build_parser, build_plugins, parse_config

    try:
        with _captured() as (_, err):
            config = parse_config(["--config", str(path)])
    except SystemExit as exc:
        if exc.code in (0, None):
            return
        options = list(build_parser().get_defaults().keys())
        raise RecipeError(explain(_error_line(err.getvalue()), "recipe.dataflow",
                                  yaml.safe_load(path.read_text()), options)) from None
    try:
        build_plugins(config)
    except (ValueError, TypeError) as exc:
        raise RecipeError(f"recipe.dataflow.{exc}") from None
    for where, spec in (("source", config.source), ("eval.source", config.eval.source)):
        check_prompt_source(spec, f"recipe.dataflow.{where}")


def _check_raas(index: int, path: Path, url: str) -> None:
    from astralight.raas.config import RaaSConfig, build_parser, validate

    where = f"recipe.raas[{index}]"
    parser = build_parser()
    try:
        with _captured() as (_, err):
            ns = parser.parse_args(["--config", str(path), "--dataflow", url])
    except SystemExit as exc:
        if exc.code in (0, None):
            return
        raise RecipeError(explain(_error_line(err.getvalue()), where,
                                  yaml.safe_load(path.read_text()),
                                  list(parser.get_defaults().keys()))) from None
    values = {k: v for k, v in vars(ns).items() if k not in ("config", "__path__")}
    config = RaaSConfig(**{k: values[k] for k in RaaSConfig.__dataclass_fields__ if k in values})
    if not config.model_ids:
        config.model_ids = list(config.engines)
    try:
        validate(config)
    except ValueError as exc:
        raise RecipeError(f"{where}.{exc}") from None


def _precheck_trainer_keys(recipe: dict) -> None:
    """Each trainer's ``trainer:`` keys against :func:`trainer_arguments` (no import)."""
    names = None
    for i, cfg in enumerate(recipe.get("trainers") or []):
        section = cfg.get("trainer") if isinstance(cfg, dict) else None
        if not isinstance(section, dict):
            continue
        names = trainer_arguments() if names is None else names
        if names is None:
            return
        for key in section:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise RecipeError(f"recipe.trainers[{i}].trainer.{key}: unknown key (Lightning's "
                                  f"Trainer has no argument {key!r}){hint}; see "
                                  "`astralight fit --help`")


def _check_trainer(index: int, name: str, path: Path) -> None:
    from astralight.trainer.trainer_cli import main as fit_main

    where = f"recipe.trainers[{index}]"
    try:
        with _captured() as (_, err):
            fit_main(["--config", str(path), "--print_config"])
    except SystemExit as exc:
        if exc.code in (0, None):
            return
        message = explain(_error_line(err.getvalue()), where, yaml.safe_load(path.read_text()))
        raise RecipeError(f"{message} ({name}; see `astralight fit --help`)") from None


def _stand_in_models(configs: dict[str, dict], stand_in: Path) -> None:
    """Create the folders under the stand-in init model that configs name as models, so the
    parsers that require an existing model folder accept them."""
    for cfg in configs.values():
        for _, _, value in _walk_paths(cfg, "", MODEL_PATH_KEYS):
            if _is_under(value, stand_in):
                Path(value).mkdir(parents=True, exist_ok=True)


# ------------------------------------------------------------------------------------ the check


def check_recipe(recipe_path: Path, recipe: dict | None = None, run_dir: Path | None = None,
                 components: bool = True) -> CheckResult:
    """Check ``recipe_path`` (or the already loaded ``recipe`` read from it) as described in the
    module docstring; raise RecipeError naming the key, or return what was checked.

    ``run_dir``: the run folder the run will use, when known (``--run-dir``, ``--resume``): its
    prepared init model is then used if it is built. ``components=False`` checks the recipe,
    the ``prepare`` step and the paths only (no component parser is imported).
    """
    from astralight.launch import _free_port, build_components, component_configs
    from astralight.launch.guard import GuardError, guard_settings
    from astralight.launch.stop import (StopError, resolve_versions, stop_settings,
                                        trainer_max_time_s)

    t0 = time.monotonic()
    recipe_path = Path(recipe_path)
    recipe = load_recipe(recipe_path) if recipe is None else recipe
    result = CheckResult(recipe=str(recipe_path))
    try:  # stop.versions and the trainers' max_steps in step, as the launcher derives them
        recipe = resolve_versions(recipe)
        stop_settings(recipe["stop"], trainer_max_time_s(recipe))
        guard_settings(recipe.get("guard"))
    except (StopError, GuardError) as exc:
        raise RecipeError(str(exc)) from None
    for i, folder in enumerate(recipe_pythonpath(recipe)):
        if not Path(folder).is_dir():
            raise RecipeError(f"recipe.pythonpath[{i}]: {folder} is not a folder (entries are "
                              "relative to the recipe's folder)")
    use_pythonpath(recipe)
    if components:
        _precheck_trainer_keys(recipe)  # before any slow import: a typo there fails at once
    func = _check_prepare(recipe)  # with the launcher's own sys.path (the recipe's pythonpath)
    with tempfile.TemporaryDirectory(prefix="astralight-check-") as tmp:
        tmp_dir = Path(tmp)
        run_folder = Path(run_dir).resolve() if run_dir is not None else tmp_dir / "run"
        port = int(recipe.get("port") or _free_port())
        url = f"http://127.0.0.1:{port}"
        values = {"run_dir": run_folder, "seed": recipe.get("seed", 0), "dataflow_url": url}
        stand_in = None
        prepared = run_folder / "models" / "init"  # where the launcher's prepare step builds it
        if func is None:
            init_model = ""
        elif prepared.is_dir() and any(prepared.iterdir()):  # built (a resumed run)
            init_model = str(prepared)
        else:
            stand_in = tmp_dir / "init-model"
            init_model = str(stand_in)
            result.notes.append(f"{{init_model}}: built by recipe.prepare.function "
                                f"({recipe['prepare']['function']}) when the run starts")
        recipe = substitute(recipe, values)
        _check_paths((recipe.get("prepare") or {}).get("kwargs") or {}, "recipe.prepare.kwargs",
                     run_folder, None, result)
        recipe = substitute(recipe, {"init_model": init_model})
        configs = component_configs(recipe, run_folder, port)
        result.components = list(configs)
        trainer_names = [n for n in configs if n.startswith("trainer-")]  # in recipe order
        for name, cfg in configs.items():
            kind, _, rest = name.partition("-")
            where = ("recipe.dataflow" if kind == "dataflow" else
                     f"recipe.raas[{rest}]" if kind == "raas" else
                     f"recipe.trainers[{trainer_names.index(name)}]")
            _check_paths(cfg, where, run_folder, stand_in, result)
        build_components(recipe, tmp_dir / "components", url, port)  # tokens, cpu_affinity
        _check_links(recipe)
        if components:
            if stand_in is not None:
                _stand_in_models(configs, stand_in)
            folder = tmp_dir / "configs"
            folder.mkdir()
            paths = {}
            for name, cfg in configs.items():
                paths[name] = folder / f"{name}.yaml"
                paths[name].write_text(yaml.safe_dump(cfg, sort_keys=False))
            with _sys_path(_kind_pythonpath(recipe, "dataflow")):
                _check_dataflow(paths["dataflow"])
            with _sys_path(_kind_pythonpath(recipe, "raas")):
                for i in range(len(recipe["raas"])):
                    _check_raas(i, paths[f"raas-{i}"], url)
            with _sys_path(_kind_pythonpath(recipe, "trainer")):
                for i, name in enumerate(trainer_names):
                    _check_trainer(i, name, paths[name])
    result.seconds = time.monotonic() - t0
    return result


#: VLLMEngine's ``max_lora_rank`` and LoraSpec's ``r`` when a config sets none (kept equal to the
#: defaults there: tests/unit/test_recipe_check.py compares them)
VLLM_ENGINE_MAX_LORA_RANK = 16
LORA_DEFAULT_R = 8


def _check_links(recipe: dict) -> None:
    """What no one component's parser sees: the recipe's fixed ``port`` is free, every trainer's
    policy is one of the dataflow's ``model_ids``, its data module reads that policy and, when it
    publishes LoRA adapters, its engines load them (``enable_lora``, ``max_lora_rank`` >= the
    adapter's ``r``), and every
    RaaS workflow answers to the dataflow's ``workflow`` name (the dataflow refuses a RaaS of
    another workflow at registration, and it would sit idle)."""
    import importlib
    import socket

    port = recipe.get("port")
    if port:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", int(port)))
            except OSError as exc:
                raise RecipeError(f"recipe.port: {port} is in use on this machine ({exc.strerror}); "
                                  "stop what holds it, pick another, or leave port unset for a "
                                  "free one") from None
    dataflow = recipe.get("dataflow") or {}
    model_ids = list(dataflow.get("model_ids") or ["policy"])
    for i, trainer in enumerate(recipe.get("trainers") or []):
        mid = ((trainer.get("model") or {}).get("init_args") or {}).get("model_id", "policy")
        if mid not in model_ids:
            raise RecipeError(f"recipe.trainers[{i}].model.init_args.model_id: {mid!r} is not one "
                              f"of recipe.dataflow.model_ids {model_ids}; the trainer would wait "
                              "for batches that never come")
        lora = ((trainer.get("model") or {}).get("init_args") or {}).get("lora")
        if isinstance(lora, dict) and lora.get("publish", "adapter") == "adapter":
            for j, raas in enumerate(recipe.get("raas") or []):
                engine = (raas.get("engines") or {}).get(mid)
                if isinstance(engine, dict) and "class_path" not in engine and not engine.get(
                        "enable_lora"):
                    raise RecipeError(
                        f"recipe.raas[{j}].engines.{mid}.enable_lora: the trainer publishes LoRA "
                        f"adapters (recipe.trainers[{i}].model.init_args.lora.publish: adapter), "
                        "which this engine cannot load, so the run would stall at version 1; "
                        "set enable_lora: true (and max_lora_rank >= lora.r), or publish: merged "
                        "(full weights as deltas; the faster choice on a CPU engine)")
                rank = int((engine or {}).get("max_lora_rank", VLLM_ENGINE_MAX_LORA_RANK)) \
                    if isinstance(engine, dict) and "class_path" not in engine else None
                r = lora.get("r", LORA_DEFAULT_R)
                if rank is not None and isinstance(r, int) and r > rank:
                    raise RecipeError(
                        f"recipe.raas[{j}].engines.{mid}.max_lora_rank: {rank}, below the "
                        f"trainer's adapter rank (recipe.trainers[{i}].model.init_args.lora.r: "
                        f"{r}); the engine would refuse every adapter version and the run would "
                        f"stall at version 1; set max_lora_rank: {r} or more")
        data_mid = ((trainer.get("data") or {}).get("init_args") or {}).get("model_id")
        if data_mid is not None and data_mid != mid:
            raise RecipeError(f"recipe.trainers[{i}].data.init_args.model_id: {data_mid!r}, but "
                              f"the trainer's policy is {mid!r} (model.init_args.model_id); "
                              "remove it (it follows the model's) or make them equal")
    for j, raas in enumerate(recipe.get("raas") or []):
        engines = list(raas.get("engines") or {})
        stray = [m for m in (raas.get("model_ids") or engines) if m not in model_ids]
        if stray:
            keep = [m for m in engines if m in model_ids]
            raise RecipeError(
                f"recipe.raas[{j}].model_ids: {stray} are not in recipe.dataflow.model_ids "
                f"{model_ids} (raas model_ids default to the keys of engines), so the dataflow "
                f"would refuse this RaaS; to serve {stray} frozen (never trained: a model an "
                f"agent team calls), set recipe.raas[{j}].model_ids: {keep}, else add them to "
                "recipe.dataflow.model_ids with a trainer each")
    wanted = dataflow.get("workflow", "single_turn")
    for i, raas in enumerate(recipe.get("raas") or []):
        path = (raas.get("workflow") or {}).get("class_path")
        if not isinstance(path, str) or "." not in path:
            continue  # the RaaS parser names a missing or bad class_path
        module, _, attr = path.rpartition(".")
        with _sys_path(_kind_pythonpath(recipe, "raas")):
            try:
                name = getattr(getattr(importlib.import_module(module), attr), "name", "")
            except (ImportError, AttributeError):
                continue  # likewise
        if name and name != wanted:
            raise RecipeError(f"recipe.raas[{i}].workflow: {path} runs {name!r} tasks, but "
                              f"recipe.dataflow.workflow is {wanted!r}; set dataflow.workflow: "
                              f"{name} (or use a {wanted} workflow)")


__all__ = ["CheckResult", "check_recipe", "MODEL_PATH_KEYS", "DATA_PATH_KEYS"]


def check_prompt_source(spec: Any, where: str) -> None:
    """Refuse a prompt-source spec (``{class_path, init_args}``) that jsonargparse cannot build
    as a :class:`~astralight.tasks.base.PromptSource`: a RecipeError naming ``where``."""
    from jsonargparse import ArgumentParser

    from astralight.tasks.base import PromptSource

    if spec is None:
        return
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--source", type=PromptSource)
    try:
        parser.parse_object({"source": spec})
    except Exception as exc:
        message = re.sub(r'^Parser key "source":', "", str(exc).strip())
        raise RecipeError(explain(message, where)) from None
