"""A recipe's ``pythonpath:``: folders relative to the recipe's own folder, put on the launcher's
``sys.path`` (it imports ``prepare`` functions) and in front of every component's PYTHONPATH."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from astralight.launch import build_components, prepare_initial_model
from astralight.launch.recipe import (
    RecipeError,
    load_recipe,
    resolve_recipe,
    use_pythonpath,
    with_pythonpath,
)

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples" / "toy" / "recipe.yaml"
AUTOSCALE = ROOT / "configs" / "toy" / "autoscale.yaml"

PREPARE = '''
import json
from pathlib import Path


def build(out_dir, answer=0, **_):  # the toy's prepare kwargs are merged in too
    Path(out_dir).mkdir(parents=True)
    (Path(out_dir) / "config.json").write_text(json.dumps({"answer": answer, "vocab_size": 8}))
'''


def write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def test_entries_are_relative_to_the_folder_of_the_recipe_that_says_them(tmp_path):
    write(tmp_path / "base" / "parent.yaml", {"extends": str(TOY), "pythonpath": ["plugins"]})
    child = write(tmp_path / "variants" / "child.yaml", {"extends": "../base/parent.yaml"})
    assert resolve_recipe(child)["pythonpath"] == [str((tmp_path / "base" / "plugins").resolve())]
    own = write(tmp_path / "variants" / "own.yaml",
                {"extends": "../base/parent.yaml", "pythonpath": [".", "../shared"]})
    assert load_recipe(own)["pythonpath"] == [str((tmp_path / "variants").resolve()),
                                              str((tmp_path / "shared").resolve())]
    with pytest.raises(RecipeError, match=r"recipe\.pythonpath: .* must be a list of folders"):
        load_recipe(write(tmp_path / "bad.yaml", {"extends": str(TOY), "pythonpath": [3]}))


def test_every_component_gets_it_in_front_of_its_own_pythonpath(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/from/the/shell")
    recipe = load_recipe(write(tmp_path / "r.yaml", {
        "extends": str(TOY), "pythonpath": ["plugins"],
        "env": {"trainer": {"PYTHONPATH": "examples/mine"}}}))
    plugins = str((tmp_path / "plugins").resolve())
    comps = build_components(recipe, tmp_path / "run", "http://127.0.0.1:1", 1)
    paths = {c.name: c.child_env()["PYTHONPATH"].split(os.pathsep) for c in comps}
    assert set(paths) == {"dataflow", "raas-0", "trainer-policy"}
    assert paths["dataflow"] == [plugins, "/from/the/shell"]
    assert paths["raas-0"] == [plugins, "/from/the/shell"]
    assert paths["trainer-policy"] == [plugins, "examples/mine"]  # its own env replaces the shell's
    # the autoscaler, whose RaaS instances inherit its environment
    recipe = load_recipe(write(tmp_path / "a.yaml", {"extends": str(AUTOSCALE),
                                                     "pythonpath": ["plugins"]}))
    comps = build_components(recipe, tmp_path / "run-a", "http://127.0.0.1:1", 1)
    assert {c.name for c in comps} == {"dataflow", "autoscale", "trainer-policy"}
    for comp in comps:
        assert comp.child_env()["PYTHONPATH"].split(os.pathsep)[0] == plugins


def test_without_pythonpath_nothing_changes():
    env = {"OMP_NUM_THREADS": 1}
    assert with_pythonpath({"dataflow": {}}, env) is env


def test_the_launcher_imports_a_prepare_function_from_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "my_prepare_plugin.py").write_text(PREPARE)
    recipe = load_recipe(write(tmp_path / "r.yaml", {
        "extends": str(TOY), "pythonpath": ["plugins"],
        "prepare": {"function": "my_prepare_plugin.build", "kwargs": {"answer": 42}}}))
    with pytest.raises(ModuleNotFoundError):
        prepare_initial_model(recipe, tmp_path / "run0")
    assert use_pythonpath(recipe) == [str((tmp_path / "plugins").resolve())]
    assert use_pythonpath(recipe) == []  # once
    out = prepare_initial_model(recipe, tmp_path / "run")
    assert yaml.safe_load((Path(out) / "config.json").read_text())["answer"] == 42
    sys.modules.pop("my_prepare_plugin", None)
