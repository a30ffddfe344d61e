"""``astralight run RECIPE --export-configs DIR`` writes the recipe's own values: its port, a run
folder named after it, the init model where its prepare step builds it, and ``vocab_sizes``."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from astralight.launch import EXPORT_PORT, export_configs, main, prepared_vocab_size
from astralight.launch.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples" / "toy" / "recipe.yaml"


def exported(out: Path) -> dict:
    return {p.stem: yaml.safe_load(p.read_text()) for p in out.glob("*.yaml")}


def test_the_recipes_port_name_and_prepared_model_are_written(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(yaml.safe_dump({"extends": str(TOY), "name": "mine", "port": 8555}))
    configs = exported(export_configs(recipe, tmp_path / "out")[0].parent)
    dataflow, raas, trainer = configs["dataflow"], configs["raas"], configs["trainer"]
    assert dataflow["port"] == 8555 and dataflow["state_dir"] == "runs/mine/dataflow"
    assert trainer["data"]["init_args"]["dataflow_url"] == "http://127.0.0.1:8555"
    assert trainer["trainer"]["default_root_dir"] == "runs/mine"
    assert trainer["model"]["init_args"]["model_path"] == "runs/mine/models/init"
    assert raas["engines"]["policy"]["model_path"] == "runs/mine/models/init"
    # not built yet: the prepare function says its vocabulary (the tiny model's 96 ids)
    assert not Path("runs/mine/models/init").exists()
    assert dataflow["vocab_sizes"] == {"policy": 96}
    assert prepared_vocab_size(load_recipe(recipe)) == 96


def test_given_values_win_and_a_built_model_gives_its_vocab_size(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 50}))
    out = tmp_path / "out"
    export_configs(TOY, out, port=9100, run_dir=str(tmp_path / "run"), init_model=str(model))
    configs = exported(out)
    assert configs["dataflow"]["port"] == 9100
    assert configs["dataflow"]["state_dir"] == str(tmp_path / "run" / "dataflow")
    assert configs["trainer"]["model"]["init_args"]["model_path"] == str(model)
    assert configs["dataflow"]["vocab_sizes"] == {"policy": 50}


def test_without_a_port_in_the_recipe_the_fixed_default_is_used(tmp_path):
    export_configs(TOY, tmp_path)
    assert exported(tmp_path)["dataflow"]["port"] == EXPORT_PORT == 8400


def test_the_command_line_flags(tmp_path, capsys):
    assert main([str(TOY), "--export-configs", str(tmp_path / "out"), "--port", "9200",
                 "--run-dir", str(tmp_path / "r")]) == 0
    configs = exported(tmp_path / "out")
    assert configs["dataflow"]["port"] == 9200
    assert configs["raas"]["engines"]["policy"]["model_path"] == str(tmp_path / "r" / "models" / "init")
    err = capsys.readouterr().err
    assert "not built yet" in err and "--init-model" in err


def test_every_multi_agent_policy_gets_its_vocab_size(tmp_path):
    export_configs(ROOT / "examples" / "multi_agent" / "recipe.yaml", tmp_path)
    assert exported(tmp_path)["dataflow"]["vocab_sizes"] == {"solver": 96, "verifier": 96}
