"""Config mistakes fail before anything starts, with a message naming the key and the fix:
a missing model folder (trainer and RaaS), a RaaS engine argument typo, an abbreviated trainer
option, and a dataflow
``class_path`` that cannot be imported (it escaped jsonargparse as a traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = """workflow:
  class_path: astralight.workflows.single_turn.SingleTurnWorkflow
  init_args:
    reward: {class_path: astralight.rewards.toy.ExactMatchReward}
"""


def _raas(tmp_path, engine: str):
    from astralight.raas.config import parse_config

    path = tmp_path / "raas.yaml"
    path.write_text(f"engines:\n  policy:\n{engine}{WORKFLOW}")
    return parse_config(["--dataflow", "http://127.0.0.1:1", "--config", str(path)])


def test_a_raas_engine_typo_names_the_key_and_the_closest_argument(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ValueError, match=r"engines\.policy\.max_model_length: VLLMEngine has no "
                                         r"argument 'max_model_length'; did you mean "
                                         r"'max_model_len'\?"):
        _raas(tmp_path, f"    model_path: {tmp_path / 'm'}\n    max_model_length: 64\n")
    config = _raas(tmp_path, f"    model_path: {tmp_path / 'm'}\n    max_model_len: 64\n")
    assert config.engines["policy"]["max_model_len"] == 64


def test_a_missing_local_model_folder_is_named_for_the_raas(tmp_path):
    with pytest.raises(ValueError, match=r"engines\.policy\.model_path: '/nonexistent' does not "
                                         r"exist"):
        _raas(tmp_path, "    model_path: /nonexistent\n")
    # a relative folder of more than two parts is a path, not a hub id
    with pytest.raises(ValueError, match=r"engines\.policy\.model_path: 'runs/toy/models/init' "
                                         r"does not exist"):
        _raas(tmp_path, "    model_path: runs/toy/models/init\n")
    # a hub id is left to the engine (it may be downloadable where the RaaS runs)
    assert _raas(tmp_path, "    model_path: Qwen/Qwen3-8B\n").engines["policy"]["model_path"]


def test_a_missing_local_model_folder_is_named_for_the_trainer(capsys):
    from astralight.trainer.trainer_cli import main

    with pytest.raises(SystemExit) as info:
        main(["--config", str(ROOT / "configs" / "toy" / "trainer.yaml"),
              "--model.init_args.model_path", "/nonexistent"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "model.init_args.model_path: '/nonexistent' does not exist" in err
    assert "Repo id" not in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:  # relative, as a component config often says it
        main(["--config", str(ROOT / "configs" / "toy" / "trainer.yaml"),
              "--model.init_args.model_path", "runs/toy/models/init"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "model.init_args.model_path: 'runs/toy/models/init' does not exist" in err
    assert "Repo id" not in err and "Traceback" not in err


def test_an_abbreviated_trainer_option_is_refused_not_expanded(capsys):
    """``--trainer.max_step`` is a typo, not ``--trainer.max_steps`` (argparse would expand it)."""
    from astralight.trainer.trainer_cli import main

    with pytest.raises(SystemExit) as info:
        main(["--config", str(ROOT / "configs" / "toy" / "trainer.yaml"),
              "--trainer.max_step=3", "--print_config"])
    assert info.value.code == 2
    assert "unrecognized arguments: --trainer.max_step=3" in capsys.readouterr().err


def test_an_unimportable_class_path_in_the_dataflow_config_names_its_key(tmp_path, capsys):
    from astralight.dataflow.config import parse_config

    path = tmp_path / "dataflow.yaml"
    path.write_text("model_ids: [policy]\nsource:\n  class_path: astralight.tasks.nope.Missing\n")
    with pytest.raises(SystemExit) as info:
        parse_config(["--config", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "source.class_path: cannot import 'astralight.tasks.nope.Missing'" in err
