"""``examples/custom_task``: a prompt source and a reward of one's own, plugged into the toy
recipe by import path. The classes do what their docstrings say, and the recipe's component
configs -- exported as the launcher writes them -- load them through the loaders the dataflow
(``parse_config`` + ``instantiate_plugin``) and the RaaS (``parse_config``, which builds the
workflow and its reward) use, with the recipe's ``pythonpath`` on ``sys.path`` as the launcher
puts it. (``tests/integration/test_custom_task_example.py`` starts the real dataflow process.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from astralight.dataflow import evals
from astralight.dataflow.config import instantiate_plugin
from astralight.dataflow.config import parse_config as parse_dataflow_config
from astralight.launch import export_configs
from astralight.launch.recipe import load_recipe, use_pythonpath
from astralight.tasks.base import PromptSource

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_task"
RECIPE = EXAMPLE / "recipe.yaml"


@pytest.fixture
def my_task(monkeypatch):
    """The example module, imported as the components import it: from the recipe's
    ``pythonpath`` (put on ``sys.path`` here as the launcher does for itself)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_task", raising=False)
    assert use_pythonpath(load_recipe(RECIPE)) == [str(EXAMPLE)]
    import my_task

    return my_task


def test_the_source_never_trains_on_the_held_out_pairs(my_task):
    train = my_task.HeldOutSums(split="train")
    prompts = [train.get(i) for i in range(500)]
    pairs = [tuple(int(x) for x in p.prompt_id.split("+")) for p in prompts]
    assert not any(my_task.held_out(a, b) for a, b in pairs)
    assert all(p.prompt == f"{a}+{b}=" and p.metadata == {"answer": str(a + b)}
               for p, (a, b) in zip(prompts, pairs))
    assert train.get(7).prompt == my_task.HeldOutSums(split="train").get(7).prompt  # seeded
    ev = my_task.HeldOutSums(split="eval", eval_size=200)
    held = [ev.get(i).prompt_id for i in range(len(ev))]
    assert len(ev) == 200 and len(set(held)) == 200
    assert all(my_task.held_out(*map(int, h.split("+"))) for h in held)
    with pytest.raises(IndexError):
        ev.get(200)
    with pytest.raises(ValueError, match="split"):
        my_task.HeldOutSums(split="test")


def test_the_reward_is_graded_and_only_exact_answers_pass(my_task):
    reward = my_task.DigitCredit(partial=0.4)
    meta = {"answer": "82"}
    assert reward("82", meta) == 1.0 and reward(" 82\n", meta) == 1.0
    assert reward("83", meta) == pytest.approx(0.2)  # one of two digits right, in place
    assert reward("12", meta) == pytest.approx(0.2) and reward("35", meta) == 0.0
    assert reward("8+2", meta) == 0.0 and reward("", meta) == 0.0
    with pytest.raises(ValueError, match="partial"):
        my_task.DigitCredit(partial=0.6)
    with pytest.raises(KeyError, match="answer"):
        reward("1", {})
    # pass@k counts a sample correct when its reward is above 0.5: partial credit never passes
    import numpy as np

    from astralight.protocol import Sample

    samples = [Sample(task_id="t", sample_index=i, model_id="policy",
                      token_ids=np.array([1, 2], np.int32), logprobs=np.zeros(2, np.float32),
                      loss_mask=np.array([0, 1], np.uint8), versions=np.array([-1, 0], np.int32),
                      reward=reward(text, meta))
               for i, text in enumerate(["82", "83", "12"])]
    assert evals.summarize(samples)["n_correct"] == 1


def test_the_recipes_component_configs_load_the_plugins_by_import_path(my_task, tmp_path,
                                                                       tiny_model_dir):
    files = {p.stem: p for p in export_configs(RECIPE, tmp_path / "configs", port=8499,
                                               run_dir=str(tmp_path / "run"),
                                               init_model=str(tiny_model_dir))}
    assert set(files) == {"dataflow", "raas", "trainer"}

    # the dataflow: its config parser, then the plugin loader its core builds the sources with
    cfg = parse_dataflow_config(["--config", str(files["dataflow"])])
    source = instantiate_plugin(cfg.source, PromptSource, "source")
    eval_source = instantiate_plugin(cfg.eval.source, PromptSource, "eval.source")
    assert type(source) is my_task.HeldOutSums and source.split == "train"
    assert type(eval_source) is my_task.HeldOutSums and len(eval_source) == 200

    # the RaaS: its config parser instantiates the workflow, and the workflow its reward
    from astralight.raas.config import parse_config as parse_raas_config

    raas = parse_raas_config(["--dataflow", "http://127.0.0.1:8499", "--config",
                              str(files["raas"])])
    assert raas.workflow.name == cfg.workflow == "single_turn"  # the names the dataflow checks
    assert type(raas.workflow.reward) is my_task.DigitCredit
    assert raas.workflow.reward.partial == 0.4
    # everything else is the toy's
    toy = yaml.safe_load((ROOT / "examples" / "toy" / "recipe.yaml").read_text())
    assert raas.max_concurrency == toy["raas"][0]["max_concurrency"]
    assert cfg.eval.every == toy["dataflow"]["eval"]["every"]
