"""``astralight run --export-configs DIR``: each component's config of a recipe, written for
starting the components by hand, placeholders filled with the recipe's own values."""

from __future__ import annotations

import importlib
from pathlib import Path

from astralight.launch.components import _write_yaml, component_configs
from astralight.launch.recipe import load_recipe, substitute


#: the dataflow's port in exported configs when the recipe sets none (a run picks a free one;
#: components started by hand need a fixed one)
EXPORT_PORT = 8400


def export_values(recipe: dict, recipe_path: Path, port: int | None = None,
                  run_dir: str | None = None, init_model: str | None = None) -> dict:
    """The placeholder values of an export, each the recipe's own unless given: the dataflow's
    ``port`` (the recipe's ``port``, else :data:`EXPORT_PORT`), ``run_dir`` (``runs/NAME``, NAME
    the recipe's ``name``), ``init_model`` (where the launcher's prepare step builds it,
    ``RUN_DIR/models/init``; empty without a prepare step), ``seed``, ``dataflow_url``."""
    port = int(port if port is not None else recipe.get("port") or EXPORT_PORT)
    run_dir = str(run_dir if run_dir is not None
                  else Path("runs") / str(recipe.get("name") or Path(recipe_path).stem))
    if init_model is None:
        init_model = str(Path(run_dir) / "models" / "init") if recipe.get("prepare") else ""
    return {"run_dir": run_dir, "init_model": str(init_model), "seed": recipe.get("seed", 0),
            "dataflow_url": f"http://127.0.0.1:{port}", "port": port}


def prepared_vocab_size(recipe: dict) -> int | None:
    """The vocabulary size of the model(s) the recipe's ``prepare`` step builds, before it is
    built: the prepare function's ``vocab_size`` attribute, called with the step's ``kwargs``
    (the shipped builders have one; see :mod:`astralight.tasks.warmstart`). None when the
    function has none or it cannot tell."""
    prep = recipe.get("prepare") or {}
    target = prep.get("function")
    if not isinstance(target, str) or "." not in target:
        return None
    module_name, func_name = target.rsplit(".", 1)
    try:
        hook = getattr(getattr(importlib.import_module(module_name), func_name), "vocab_size", None)
        size = hook(**(prep.get("kwargs") or {})) if callable(hook) else None
    except Exception:  # an export goes on without it (the dataflow then checks no token ids)
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def export_configs(recipe_path: Path, out_dir: Path, port: int | None = None,
                   run_dir: str | None = None, init_model: str | None = None) -> list[Path]:
    """Write each component's config of a recipe to ``out_dir``, for starting components by hand.

    Placeholders become the recipe's values (:func:`export_values`; ``port``, ``run_dir`` and
    ``init_model`` override them). The dataflow's ``vocab_sizes`` come from each trainer's model
    folder, or -- for a model the recipe's prepare step has not built yet -- from the prepare
    function (:func:`prepared_vocab_size`), so the exported dataflow refuses out-of-range token
    ids as the launcher's would.
    """
    recipe = load_recipe(recipe_path)
    values = export_values(recipe, recipe_path, port, run_dir, init_model)
    port = values.pop("port")
    recipe = substitute(recipe, values)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = component_configs(recipe, Path(values["run_dir"]), port)
    dataflow_cfg = configs["dataflow"]
    init = values["init_model"]
    for name, cfg in configs.items():
        init_args = (((cfg.get("model") or {}).get("init_args") or {})
                     if name.startswith("trainer-") else {})
        model_id, model_path = init_args.get("model_id"), str(init_args.get("model_path") or "")
        if (model_id is None or model_id in (dataflow_cfg.get("vocab_sizes") or {})
                or model_id not in dataflow_cfg.get("model_ids", ["policy"])
                or not init or not (model_path == init or model_path.startswith(init + "/"))):
            continue
        size = prepared_vocab_size(recipe)
        if size is not None:
            dataflow_cfg.setdefault("vocab_sizes", {})[model_id] = size
    return [_write_yaml(out_dir / f"{file_stem}.yaml", configs[name])
            for name, file_stem in export_file_stems(list(configs)).items()]


def export_file_stems(names: list[str]) -> dict[str, str]:
    """The file name (without ``.yaml``) each component's config is exported under: its kind
    (``dataflow``, ``raas``, ``trainer``) when it is the only one of its kind, else its whole
    name (``trainer-solver``, ``trainer-verifier``, ``raas-0``, ``raas-1``), so no two
    components of a recipe share a file."""
    kinds = [name.split("-")[0] for name in names]
    return {name: kind if kinds.count(kind) == 1 else name for name, kind in zip(names, kinds)}
