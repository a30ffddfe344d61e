"""``astralight fit``: a LightningCLI over an :class:`astralight.policy.RLPolicy` and a DataModule.

The model and data are in subclass mode, so a config says
``model: {class_path: astralight.policy.M2POPolicy, init_args: {...}}`` and a user's own policy
plugs in the same way. ``fit`` is implied: ``astralight fit --config trainer.yaml``.

The model must be an ``RLPolicy`` (``astralight fit --model.help`` lists the ones imported: the
shipped :class:`~astralight.policy.M2POPolicy`, and a subclass of one's own once its module is
importable, e.g. ``--model.help reinforce.ReinforceWithBaseline`` with
``examples/custom_trainer`` on ``PYTHONPATH``). A plain ``LightningModule`` is refused when the
config is parsed: the WeightPublisher, the datamodule's acknowledgements and the launcher rely on
what ``RLPolicy`` provides (``model_id``, ``model_path``, one optimizer step per pulled batch, the
acknowledgement after it). A new objective is a subclass with one method, ``compute_loss``.

What the CLI does for its users, beyond LightningCLI:

* **one model_id** -- the datamodule's ``model_id`` is linked to ``model.init_args.model_id``
  (``link_arguments``): state it once, in the model. A config that also states
  ``data.init_args.model_id`` keeps working when the two agree and is refused, naming both keys,
  when they differ. The callbacks take ``dataflow_url`` from the datamodule and ``model_id`` from
  the module when their own are unset, so ``data.init_args.dataflow_url`` is the one place for
  the URL.
* **the optimizer** -- ``--optimizer`` / ``--lr_scheduler`` (top-level ``optimizer:`` /
  ``lr_scheduler:`` in YAML, any ``torch.optim`` class by name) are linked to the policy's
  ``optimizer`` / ``lr_scheduler`` arguments, which replace its AdamW and its warm-up (see
  :meth:`astralight.policy.RLPolicy.configure_optimizers`); Lightning's own replacement of
  ``configure_optimizers`` is off (it would build the optimizer before the model is loaded).
* **gradient clipping** -- the policy optimises manually, where Lightning's clipping cannot run
  (it refuses ``gradient_clip_val``); ``--trainer.gradient_clip_val X`` is routed to the
  policy's own clip, ``model.init_args.grad_clip`` (global norm; ``gradient_clip_algorithm:
  value`` is refused).
* **no hp_metric** -- a ``TensorBoardLogger`` (configured, or Lightning's default) gets
  ``default_hp_metric: false``: the policies report no final metric, so the tag would be a
  constant -1.
* **model_path** -- a local ``model.init_args.model_path`` that does not exist is a usage error
  naming the key.

Resume: ``astralight fit --config trainer.yaml --ckpt_path last`` (or a path) continues from a
Lightning checkpoint: the optimizer step (so the policy version the WeightPublisher numbers from),
the publisher's counters (its first publication after a resume is a full version; versions the
dataflow already holds are skipped, never published again), and the datamodule's counters. The
launcher passes ``--ckpt_path`` when it restarts a trainer or resumes a run.

SIGTERM ends the fit as if ``max_steps`` were reached -- the last checkpoint saved at that step,
the last version published -- rather than on Lightning's exception path
(:mod:`astralight.trainer.graceful_stop`): the launcher stops a run early that way.

Checkpoints are written atomically (:class:`astralight.trainer.checkpoint_io.AtomicCheckpointIO`: temp
file in the checkpoint folder, fsync, rename) unless the config chooses a checkpoint IO plugin.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from astralight.trainer.checkpoint_io import install as install_atomic_checkpoints
from astralight.trainer.graceful_stop import install as install_graceful_stop
from astralight.policy import RLPolicy

log = logging.getLogger(__name__)

#: the datamodules' ``model_id`` default: a ``data.init_args.model_id`` still at it follows the
#: module's without complaint (an explicit ``policy`` cannot be told from an unset one)
DEFAULT_MODEL_ID = "policy"


def _plain(value: Any) -> Any:
    """A jsonargparse Namespace (or anything else) as plain dicts."""
    return value.as_dict() if hasattr(value, "as_dict") else value


def link_model_id(module_id: str | None, data_id: str | None) -> str | None:
    """The datamodule's ``model_id``: the module's; a differing one stated for the datamodule
    is refused (batches of one policy trained by another's module)."""
    if data_id not in (None, DEFAULT_MODEL_ID, module_id):
        raise ValueError(
            f"data.init_args.model_id={data_id!r} differs from model.init_args.model_id="
            f"{module_id!r}; state the policy once, as model.init_args.model_id (the datamodule's "
            "is linked to it), and drop data.init_args.model_id")
    return module_id


def _link_spec(key: str, base: type):
    """compute_fn of the ``--optimizer`` / ``--lr_scheduler`` links: the top-level value, else
    the one stated in ``model.init_args`` (never silently dropped); both, differing: refused.
    The class is checked here, so a bad one is a usage error before anything is built."""
    from astralight.policy import check_class_spec

    def link(top: Any, stated: Any) -> dict | None:
        top, stated = _plain(top), _plain(stated)
        if top is not None and stated is not None and stated != top:
            raise ValueError(f"{key} and model.init_args.{key} are both set and differ; set one "
                             f"(the top-level {key}: is linked to model.init_args.{key})")
        value = top if top is not None else stated
        check_class_spec(value, key, base)
        return value

    link.__name__ = f"link_{key}"
    return link


class AstralightCLI(LightningCLI):
    """LightningCLI for policies: the links, routes and checks of the module docstring, and a
    trainer that writes checkpoints atomically."""

    def add_arguments_to_parser(self, parser) -> None:
        """The optimizer arguments and the links (see the module docstring); they need the
        policy in subclass mode (``model.init_args``) and Lightning's automatic optimizer off,
        as :func:`build` sets them up."""
        if self.subclass_mode_model and self.subclass_mode_data:
            parser.link_arguments(("model.init_args.model_id", "data.init_args.model_id"),
                                  "data.init_args.model_id", compute_fn=link_model_id)
        if not self.subclass_mode_model or self.auto_configure_optimizers:
            return
        parser.add_subclass_arguments(
            (Optimizer,), "optimizer", instantiate=False, fail_untyped=False, skip={"params"},
            required=False, help="The policy's optimizer (replaces AdamW; e.g. --optimizer SGD "
                                 "--optimizer.lr 0.01); linked to model.init_args.optimizer.")
        parser.add_subclass_arguments(
            (LRScheduler,), "lr_scheduler", instantiate=False, fail_untyped=False,
            skip={"optimizer"}, required=False,
            help="The policy's LR schedule, stepped once per optimizer step (replaces the warm-up; "
                 "e.g. --lr_scheduler CosineAnnealingLR --lr_scheduler.T_max 150); linked to "
                 "model.init_args.lr_scheduler.")
        for key, base in (("optimizer", Optimizer), ("lr_scheduler", LRScheduler)):
            parser.link_arguments((key, f"model.init_args.{key}"), f"model.init_args.{key}",
                                  compute_fn=_link_spec(key, base))

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        if config is None:
            return
        self._check_model_path(config)
        self._route_gradient_clip(config)
        _no_hp_metric(config.get("trainer"))

    def _check_model_path(self, config) -> None:
        """A local ``model.init_args.model_path`` that does not exist is a usage error (exit 2
        naming the key), not a Hugging Face hub error from deep inside the model's build."""
        from astralight.trainer.hf_models import check_model_path

        init_args = _init_args(config.get("model"))
        path = getattr(init_args, "model_path", None) if init_args is not None else None
        try:
            check_model_path(path, "model.init_args.model_path")
        except ValueError as exc:
            self.parser.error(str(exc))

    def _route_gradient_clip(self, config) -> None:
        """``trainer.gradient_clip_val`` -> ``model.init_args.grad_clip`` (see the module
        docstring); Lightning never sees it."""
        trainer = config.get("trainer")
        clip = trainer.get("gradient_clip_val") if trainer is not None else None
        if clip is None:
            return
        algorithm = trainer.get("gradient_clip_algorithm")
        if algorithm not in (None, "norm"):
            self.parser.error(
                f"trainer.gradient_clip_algorithm: {algorithm!r} is not supported: the policy "
                "clips by the global gradient norm (model.init_args.grad_clip); drop the key or "
                "set it to norm")
        init_args = _init_args(config.get("model"))
        if init_args is None:
            return
        log.info("trainer.gradient_clip_val=%s: clipping is the policy's own "
                 "(model.init_args.grad_clip) under manual optimization", clip)
        init_args["grad_clip"] = float(clip)
        trainer["gradient_clip_val"] = None
        trainer["gradient_clip_algorithm"] = None

    def instantiate_trainer(self, **kwargs) -> pl.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        install_atomic_checkpoints(trainer)
        install_graceful_stop(trainer)  # SIGTERM: finish as at max_steps (astralight.trainer.graceful_stop)
        for logger in trainer.loggers:
            # Lightning's default logger (no trainer.logger in the config) is a TensorBoardLogger
            # built without the config: the same hp_metric switch, on its attribute
            if type(logger).__name__ == "TensorBoardLogger" and hasattr(logger, "_default_hp_metric"):
                logger._default_hp_metric = False
        return trainer


def _init_args(section):
    return getattr(section, "init_args", None) if section is not None else None


def _no_hp_metric(trainer) -> None:
    """``default_hp_metric: false`` for every configured TensorBoardLogger (one or a list)."""
    if trainer is None:
        return
    loggers = trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        path = getattr(logger, "class_path", None)
        init_args = _init_args(logger)
        if isinstance(path, str) and path.endswith("TensorBoardLogger") and init_args is not None:
            init_args["default_hp_metric"] = False


#: Lightning warnings that never apply to ``astralight fit`` (message prefixes): the CLI is given
#: ``args`` on purpose (the ``fit`` subcommand is implied); the policies optimise manually and
#: checkpoint after the step (the checkpoint holds the post-step state, which is what resume
#: needs); Lightning's own pytree call on newer torch.
QUIET_WARNINGS = (
    "LightningCLI's args parameter is intended to run from within Python",
    "Using ModelCheckpoint with manual optimization and every_n_train_steps",
    "`isinstance(treespec, LeafSpec)` is deprecated",
)
#: Lightning info lines that are advertising, not information
QUIET_INFO = ("💡 Tip: For seamless cloud logging",)


def quiet_lightning_noise() -> None:
    """Silence what does not apply on every ``astralight fit`` (see :data:`QUIET_WARNINGS`,
    :data:`QUIET_INFO`); every other warning and line stays."""
    import logging
    import re
    import warnings

    for prefix in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(prefix))
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _keep_record not in logger.filters:
            logger.addFilter(_keep_record)


def _keep_record(record) -> bool:
    """Logging filter: False for the lines of :data:`QUIET_INFO`."""
    return not str(record.msg).startswith(QUIET_INFO)


def build(argv: list[str] | None = None, run: bool = True) -> AstralightCLI:
    """The CLI of ``astralight fit`` on ``argv``: runs ``fit`` (``run``), or only parses the
    config and builds the trainer, model and datamodule (``run=False``: what tests inspect)."""
    quiet_lightning_noise()
    return AstralightCLI(
        model_class=RLPolicy,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        # --optimizer / --lr_scheduler are the policy's (add_arguments_to_parser), not Lightning's
        # automatic configure_optimizers, which would build the optimizer before the model exists
        auto_configure_optimizers=False,
        args=["fit", *(argv or [])] if run else list(argv or []),
        run=run,
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        # error tips name the command a user typed ("astralight fit --help"), not "cli.py"; no
        # abbreviations: --trainer.max_step must not be taken for --trainer.max_steps
        parser_kwargs={"prog": "astralight", "allow_abbrev": False},
    )


def main(argv: list[str] | None = None) -> None:
    build(argv)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
