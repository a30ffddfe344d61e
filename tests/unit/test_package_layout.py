"""The package is laid out by process (astralight/ARCHITECTURE.md, "Repository layout"): every
module left at the top of ``astralight/`` is listed there with the reason it is shared, and the
flat import paths of the modules that moved into ``trainer/`` and ``launch/`` still load the very
same module objects (configs and checkpoints name them)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import astralight
from astralight.moved_modules import MOVED

PACKAGE = Path(astralight.__file__).parent


def _layout_block() -> str:
    doc = (PACKAGE / "ARCHITECTURE.md").read_text()
    start = doc.index("## Repository layout")
    return doc[start:doc.index("## ", start + 3)]


def test_every_top_level_module_is_in_the_layout_with_its_process():
    block = _layout_block()
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    listed = {m.group(1) for m in re.finditer(r"^  (\w+\.py)\s+(?:\[\w+\])?", block, re.M)}
    assert not set(loose) - listed, f"not in ARCHITECTURE.md's layout: {set(loose) - listed}"
    for folder in sorted(p.name for p in PACKAGE.iterdir()
                         if p.is_dir() and (p / "__init__.py").exists()):
        assert re.search(rf"^  {folder}/\s+\[\w+\]", block, re.M), f"{folder}/ has no [process]"


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_import_path_is_the_moved_module(old, new):
    assert not (PACKAGE / f"{old.rsplit('.', 1)[1]}.py").exists()  # no stub left behind
    assert importlib.import_module(old) is importlib.import_module(new)


def test_an_old_class_path_in_a_config_resolves_to_the_same_class():
    from jsonargparse import ArgumentParser

    from astralight.trainer.fsdp2_strategy import FSDP2Strategy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=type)
    assert parser.parse_args(["--strategy", "astralight.fsdp2_strategy.FSDP2Strategy"]).strategy \
        is FSDP2Strategy


def test_the_launch_package_imports_nothing_until_asked():
    code = ("import sys, astralight.launch.supervise, astralight.launch.proc;"
            "heavy = [m for m in ('astralight.launch.runner', 'astralight.launch.components',"
            " 'lightning', 'torch') if m in sys.modules]; print(heavy);"
            "from astralight.launch import main, prepare_initial_model;"
            "print(main.__module__, prepare_initial_model.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "astralight.launch.cli astralight.launch.runner"]
