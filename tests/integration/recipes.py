"""Recipes for the integration tests that run ``astralight run``: :func:`shortened_toy_recipe`,
the shipped toy recipe cut down to a few versions (a short SFT, small evals, a balance report every
2 versions), written to a YAML file.

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from astralight.launch import _default_recipe


def shortened_toy_recipe(tmp_path: Path, versions: int = 4, batch_size: int = 16) -> Path:
    recipe = yaml.safe_load(_default_recipe().read_text())
    recipe["prepare"]["kwargs"]["sft_steps"] = 20
    recipe["stop"].update(versions=versions, timeout_s=480, progress_every_s=5)
    recipe["dataflow"]["eval"].update(every=2, k=2)
    recipe["dataflow"]["eval"]["source"]["init_args"]["eval_size"] = 16
    recipe["balance"] = {"every": 2}
    trainer = recipe["trainers"][0]
    trainer["trainer"]["max_steps"] = versions
    trainer["data"]["init_args"]["batch_size"] = batch_size
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path
