"""Every YAML file under configs/ is loaded and validated the way its component would load it.

- ``dataflow*.yaml``: ``astralight.dataflow.config.parse_config`` (every field checked), and the
  prompt sources checked against their class signatures (import path, argument names and types)
  without reading their data files, which live on GPU clusters, not here;
- ``raas*.yaml``: ``raas.config.parse_config`` (builds the workflow and its reward, not engines);
- ``trainer*.yaml``: ``astralight fit --config F --print_config`` (LightningCLI parses the trainer,
  strategy, callbacks, module and datamodule; nothing is instantiated);
- anything else is a recipe: ``astralight.launch.recipe.load_recipe``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from astralight.launch.check import check_prompt_source
from astralight.launch.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def _kind(path: Path) -> str:
    for kind in ("dataflow", "raas", "trainer"):
        if path.name.startswith(kind):
            return kind
    return "recipe"


def _check_source(spec: dict | None, where: str) -> None:
    try:
        check_prompt_source(spec, where)
    except RecipeError as exc:  # pragma: no cover - the assertion message is the point
        pytest.fail(str(exc))


def test_configs_exist():
    names = {p.relative_to(ROOT / "configs").as_posix() for p in CONFIGS}
    assert "qwen3_8b/solver_verifier_math/dataflow.yaml" in names
    assert {_kind(p) for p in CONFIGS} >= {"dataflow", "raas", "trainer", "recipe"}


@pytest.mark.parametrize("path", [p for p in CONFIGS if _kind(p) == "dataflow"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_dataflow_config(path):
    from astralight.dataflow.config import build_plugins, parse_config

    config = parse_config(["--config", str(path)])
    _check_source(config.source, f"{path}: source")
    _check_source(config.eval.source, f"{path}: eval.source")
    build_plugins(config)


@pytest.mark.parametrize("path", [p for p in CONFIGS if _kind(p) == "raas"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_raas_config(path, stand_in_search_corpora, stand_in_model_config):
    from raas.config import parse_config

    config = parse_config(["--config", str(stand_in_model_config(path))])
    assert config.model_ids and set(config.model_ids) <= set(config.engines)


@pytest.mark.parametrize("path", [p for p in CONFIGS if _kind(p) == "trainer"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_trainer_config(path):
    out = subprocess.run([sys.executable, "-m", "astralight.cli", "fit", "--config", str(path),
                          "--print_config"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    import yaml

    printed, written = yaml.safe_load(out.stdout), yaml.safe_load(path.read_text())
    assert printed["model"]["class_path"] == written["model"]["class_path"]
    assert printed["model"]["init_args"]["model_id"] == written["model"]["init_args"]["model_id"]


@pytest.mark.parametrize("path", [p for p in CONFIGS if _kind(p) == "recipe"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_recipe(path):
    from astralight.launch.recipe import load_recipe

    recipe = load_recipe(path)
    assert recipe["stop"]["versions"] > 0 and recipe["trainers"]


def test_a_bad_source_argument_is_named(tmp_path):
    """The source check is real: a misspelt init arg of a real source fails, naming it."""
    with pytest.raises(pytest.fail.Exception, match="max_prompt_tokenz"):
        _check_source({"class_path": "astralight.tasks.data.presets.DAPOMathSource",
                       "init_args": {"path": "x", "max_prompt_tokenz": 5}}, "source")


@pytest.mark.parametrize("path", [p for p in CONFIGS if _kind(p) == "trainer"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_trainer_strategy_can_train_a_policy(path):
    """No config names FSDPStrategy (FSDP1 cannot run the policy's manual-optimization steps;
    the policy refuses it); an FSDP2 config shards over all of its trainer's GPUs, no TP."""
    import yaml

    trainer = yaml.safe_load(path.read_text())["trainer"]
    strategy = trainer.get("strategy")
    name = strategy.get("class_path", "") if isinstance(strategy, dict) else str(strategy or "")
    assert "FSDPStrategy" not in name and name.lower() not in ("fsdp", "fsdp_cpu_offload")
    assert not name.endswith("ModelParallelStrategy"), "use astralight.trainer.fsdp2_strategy.FSDP2Strategy"
    if name.endswith("FSDP2Strategy"):
        args = strategy.get("init_args", {})
        gpus = int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))
        # "auto" (FSDP2Strategy: every process of the trainer) follows a --trainer.devices or
        # --trainer.num_nodes override; a number must equal the GPUs
        assert args.get("data_parallel_size", "auto") in ("auto", gpus)
        assert args.get("tensor_parallel_size", 1) == 1
        assert trainer.get("precision") == "bf16-mixed"  # fp32 masters (see astralight.trainer.fsdp2)
