"""The torchvision trap: vLLM's CPU wheel installs CUDA builds of torchvision / torchaudio /
torchcodec beside the CPU torch, and the first import of one (torchmetrics, under Lightning,
imports torchvision) fails deep inside it. ``astralight`` turns that into one line with the fix
and exit status 2, and leaves every other failure alone.

The failing imports are simulated: an import hook makes ``astralight.trainer.trainer_cli`` (what ``fit``
imports first) raise the error a broken torchvision raises, or import a stand-in package that
fails the way a build linked against missing CUDA libraries does."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

import pytest

from astralight.cli import TORCH_EXTRAS_FIX, broken_torch_extra, main


class _FailingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook: importing ``name`` runs ``fail()`` instead of the module."""

    def __init__(self, name, fail):
        self.name, self.fail = name, fail

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.fail()


def _hook(monkeypatch, fail, name="astralight.trainer.trainer_cli"):
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingImport(name, fail), *sys.meta_path])


def _raise(exc):
    def fail():
        raise exc
    return fail


def test_fit_with_a_broken_torchvision_prints_the_fix_and_exits_2(monkeypatch, capsys):
    # what torchvision's _meta_registrations raises when its C++ ops did not load
    _hook(monkeypatch, _raise(RuntimeError("operator torchvision::nms does not exist")))
    assert main(["fit", "--help"]) == 2
    err = capsys.readouterr().err
    assert "astralight fit: the installed torchvision does not match torch" in err
    assert "operator torchvision::nms does not exist" in err
    assert err.strip().splitlines()[-1].strip() == TORCH_EXTRAS_FIX
    assert TORCH_EXTRAS_FIX == "pip uninstall -y torchvision torchaudio torchcodec"


def test_a_failure_inside_a_torch_extension_is_found_through_a_vague_wrapper(tmp_path,
                                                                            monkeypatch, capsys):
    """A build linked against CUDA libraries fails in its own ``__init__``; transformers wraps
    that in "Could not import module ...": the package and the real error are still named."""
    package = tmp_path / "torchaudio"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise OSError('libcudart.so.13: cannot open shared object file: No such file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchaudio", raising=False)

    def transformers_style():
        try:
            importlib.import_module("torchaudio")
        except OSError as exc:
            raise ModuleNotFoundError("Could not import module 'Qwen3ForCausalLM'. Are this "
                                      "object's requirements defined correctly?") from exc

    _hook(monkeypatch, transformers_style)
    assert main(["fit", "--print_config"]) == 2
    err = capsys.readouterr().err
    assert "the installed torchaudio does not match torch (OSError: libcudart.so.13" in err
    assert TORCH_EXTRAS_FIX in err


def test_other_failures_are_not_mistaken_for_a_broken_extension(monkeypatch):
    assert broken_torch_extra(RuntimeError("CUDA out of memory")) is None
    assert broken_torch_extra(ValueError("operator torchvision::nms does not exist")) is None
    _hook(monkeypatch, _raise(RuntimeError("disk on fire")))
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["fit", "--help"])
