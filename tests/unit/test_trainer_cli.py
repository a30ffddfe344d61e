"""``astralight fit`` (``astralight.trainer.trainer_cli``) follows its ecosystem (issue 19, items 16, 18-20).

- the model is an ``RLPolicy``: ``--model.help`` lists the shipped policies, and a plain
  LightningModule is refused when the config is parsed, naming ``RLPolicy``;
- ``model_id`` is stated once: the datamodule's is linked to the module's, a differing one is
  refused naming both keys;
- ``--trainer.gradient_clip_val`` reaches the policy's own clip and ``Trainer.fit`` runs (it
  used to fail under manual optimization); ``gradient_clip_algorithm: value`` is refused;
- ``--optimizer`` / ``--lr_scheduler`` build the optimizer and schedule the policy steps with;
- the TensorBoard event file of a fit has no ``hp_metric`` and no duplicate ``train/m2``, and
  has ``train/entropy``.

The CLI is built with ``run=False`` (parse + instantiate) and fitted on a fake dataflow client.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from astralight.trainer.trainer_cli import build
from tests.fakes import FakeDataflowClient

ROOT = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, model_dir: Path, **overrides) -> Path:
    """A trainer config in the shape of configs/toy/trainer.yaml, model_id stated once."""
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "log_every_n_steps": 1,
                    "enable_progress_bar": False, "enable_checkpointing": False,
                    "enable_model_summary": False, "default_root_dir": str(tmp_path),
                    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": str(tmp_path / "tb"), "name": "p"}}},
        "model": {"class_path": "astralight.policy.M2POPolicy",
                  "init_args": {"model_path": str(model_dir), "model_id": "solver",
                                "lr": 1e-3}},
        "data": {"class_path": "astralight.datamodules.RolloutDataModule",
                 "init_args": {"dataflow_url": "http://127.0.0.1:1", "batch_size": 4}},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        target = config[section]["init_args"] if section in ("model", "data") else config[section]
        target[name] = value
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit(cli, model_dir, model_id="solver"):
    fake = FakeDataflowClient(model_dir, model_id=model_id, logprob_noise=0.2)
    cli.datamodule.client = fake
    fake.trainer = cli.trainer
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return fake


def usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        build(argv, run=False)
    assert info.value.code == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- 18: RLPolicy


def test_model_help_lists_the_shipped_policies():
    out = subprocess.run([sys.executable, "-m", "astralight.cli", "fit", "--help"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    assert "subclass of RLPolicy" in text
    assert "astralight.policy.M2POPolicy" in text  # among the "known subclasses"
    assert "lightning.LightningModule" not in text


def test_a_plain_lightning_module_is_refused_naming_rlpolicy(tiny_model_dir, tmp_path, capsys):
    config = write_config(tmp_path, tiny_model_dir)
    err = usage_error(["--config", str(config),
                       "--model", "lightning.pytorch.demos.boring_classes.BoringModel"], capsys)
    assert "does not correspond to a subclass of RLPolicy" in err


# ----------------------------------------------------------------------------- 20: one model_id


def test_the_datamodule_takes_the_module_model_id(tiny_model_dir, tmp_path):
    cli = build(["--config", str(write_config(tmp_path, tiny_model_dir))], run=False)
    assert cli.model.model_id == cli.datamodule.model_id == "solver"
    # stated twice, the same: still accepted (every config written before the link)
    again = build(["--config", str(write_config(tmp_path, tiny_model_dir,
                                                data__model_id="solver"))], run=False)
    assert again.datamodule.model_id == "solver"


def test_a_differing_datamodule_model_id_is_refused_naming_both_keys(tiny_model_dir, tmp_path,
                                                                    capsys):
    config = write_config(tmp_path, tiny_model_dir)
    err = usage_error(["--config", str(config), "--data.init_args.model_id", "verifier"], capsys)
    assert "data.init_args.model_id='verifier' differs from model.init_args.model_id='solver'" \
        in err
    assert "state the policy once" in err


# ----------------------------------------------------------------------------- 19: clip, optimizer


def test_gradient_clip_val_is_the_policy_clip_and_fit_runs(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir)
    cli = build(["--config", str(config), "--trainer.gradient_clip_val", "0.25"], run=False)
    assert cli.model.grad_clip == 0.25
    assert cli.trainer.gradient_clip_val is None  # Lightning refuses it under manual optimization
    fake = fit(cli, tiny_model_dir)
    assert cli.trainer.global_step == 2 and len(fake.acks) == 2
    # the policy clipped: after its own clip the global norm is at most grad_clip
    before = float(cli.trainer.callback_metrics["train/grad_norm"])
    assert before > 0.25  # the logged norm is the pre-clip norm ...
    for p in cli.model.model.parameters():  # ... and clipping brings a fresh gradient to 0.25
        p.grad = torch.ones_like(p)
    assert float(cli.model._clip_and_norm()) > 0.25
    total = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in cli.model.model.parameters()))
    assert float(total) == pytest.approx(0.25, rel=1e-3)


def test_gradient_clip_by_value_is_refused(tiny_model_dir, tmp_path, capsys):
    config = write_config(tmp_path, tiny_model_dir)
    err = usage_error(["--config", str(config), "--trainer.gradient_clip_val", "1",
                       "--trainer.gradient_clip_algorithm", "value"], capsys)
    assert "trainer.gradient_clip_algorithm: 'value' is not supported" in err


def test_optimizer_and_lr_scheduler_flags_are_what_the_policy_steps_with(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir)
    cli = build(["--config", str(config), "--optimizer", "SGD", "--optimizer.lr", "0.05",
                 "--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "1",
                 "--lr_scheduler.gamma", "0.5"], run=False)
    fit(cli, tiny_model_dir)
    (opt,) = cli.trainer.optimizers
    assert type(opt).__name__ == "SGD"
    # two optimizer steps, the rate halved after each: the second step ran at 0.025
    assert float(cli.trainer.callback_metrics["train/lr"]) == pytest.approx(0.025)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0125)
    assert cli.model.hparams["optimizer"]["class_path"] == "torch.optim.SGD"


def test_an_optimizer_stated_in_the_model_is_kept_and_a_second_one_refused(tiny_model_dir,
                                                                           tmp_path, capsys):
    sgd = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.2}}
    config = write_config(tmp_path, tiny_model_dir, model__optimizer=sgd)
    cli = build(["--config", str(config)], run=False)
    assert cli.model.optimizer_spec == sgd  # not overwritten by an unset --optimizer
    err = usage_error(["--config", str(config), "--optimizer", "Adam"], capsys)
    assert "optimizer and model.init_args.optimizer are both set and differ" in err


def test_a_plateau_scheduler_is_refused_naming_the_key(tiny_model_dir, tmp_path, capsys):
    config = write_config(tmp_path, tiny_model_dir)
    err = usage_error(["--config", str(config), "--lr_scheduler",
                       "torch.optim.lr_scheduler.ReduceLROnPlateau"], capsys)
    assert ("lr_scheduler.class_path: 'torch.optim.lr_scheduler.ReduceLROnPlateau' needs a "
            "monitored metric") in " ".join(err.split())
    # the module refuses it too when built from Python
    from astralight.policy import M2POPolicy

    with pytest.raises(ValueError, match="needs a monitored metric"):
        M2POPolicy(str(tiny_model_dir),
                   lr_scheduler={"class_path": "torch.optim.lr_scheduler.ReduceLROnPlateau"})


# ----------------------------------------------------------------------------- 16: the tags


@pytest.mark.parametrize("logger", ["configured", "lightning's default"])
def test_the_event_file_has_entropy_and_no_noise_or_duplicate_tags(tiny_model_dir, tmp_path,
                                                                   logger):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = write_config(tmp_path, tiny_model_dir)
    argv = ["--config", str(config)]
    if logger != "configured":  # no logger configured: Lightning's TensorBoardLogger
        argv.append("--trainer.logger=true")
    cli = build(argv, run=False)
    fit(cli, tiny_model_dir)
    (events,) = tmp_path.rglob("events.out.tfevents*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/entropy", "train/m2_before", "train/loss", "perf/wait_s"} <= tags
    assert "hp_metric" not in tags  # TensorBoardLogger's constant -1
    assert "train/m2" not in tags  # the same statistic as train/m2_before
    entropy = [e.value for e in acc.Scalars("train/entropy")]
    vocab = cli.model.model.config.vocab_size
    assert len(entropy) == 2 and all(0 < h <= float(torch.log(torch.tensor(vocab))) for h in entropy)
