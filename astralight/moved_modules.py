"""Old import paths of modules that moved into a process's package, kept working.

The trainer's modules live in :mod:`astralight.trainer` and the launcher's in
:mod:`astralight.launch`; configs, checkpoints and user code written against the earlier flat
layout name them as ``astralight.fsdp2_strategy.FSDP2Strategy`` and so on. A finder on
``sys.meta_path`` (installed by ``astralight/__init__.py``) resolves each old name to the very
module object of its new home, so ``class_path`` strings, ``import astralight.lora`` and
pickled references all still load, classes compare equal across both names, and no stub file is
left at the top of the package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old dotted name -> new dotted name
MOVED: dict[str, str] = {
    **{f"astralight.{m}": f"astralight.trainer.{m}" for m in (
        "checkpoint_io", "export", "fsdp2", "fsdp2_strategy", "graceful_stop", "hf_models", "lora",
        "tinymodel", "trainer_cli")},
    **{f"astralight.{m}": f"astralight.launch.{m}" for m in (
        "prewarm", "proc", "ray_process", "supervise")},
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module already imported under its new one."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:  # the target module ran its own code on import
        pass


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``MOVED``'s old names (and only those)."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
