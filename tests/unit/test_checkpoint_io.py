"""``AtomicCheckpointIO``: a checkpoint is whole or absent, whatever kills its writer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from astralight.trainer.checkpoint_io import AtomicCheckpointIO, atomic_write_bytes, install


def test_save_writes_through_a_temp_in_the_same_folder(tmp_path, monkeypatch):
    seen = []
    real_replace = __import__("os").replace

    def spy(src, dst):
        seen.append((src, dst))
        return real_replace(src, dst)

    monkeypatch.setattr("astralight.atomic_files.os.replace", spy)
    path = tmp_path / "ckpt" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 3, "w": torch.ones(4)}, path)
    [(src, dst)] = seen
    assert src.parent == path.parent and src.name.startswith(".last.ckpt.tmp-") and dst == path
    loaded = AtomicCheckpointIO().load_checkpoint(path)
    assert loaded["global_step"] == 3 and torch.equal(loaded["w"], torch.ones(4))
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_a_failed_write_keeps_the_previous_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    atomic_write_bytes(path, b"old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("astralight.atomic_files.os.fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_writer_killed_mid_save_leaves_a_loadable_checkpoint(tmp_path):
    """A child saves 16 MiB checkpoints in a loop and is SIGKILLed at some point of a save: the
    file under the final name always loads, and the next save removes the stale temp."""
    path = tmp_path / "last.ckpt"
    script = textwrap.dedent(f"""
        import torch
        from astralight.trainer.checkpoint_io import AtomicCheckpointIO
        io = AtomicCheckpointIO()
        i = 0
        while True:
            i += 1
            io.save_checkpoint({{"global_step": i, "w": torch.full((4 << 20,), float(i))}},
                               {str(path)!r})
    """)
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.7)  # several saves in, likely in the middle of one
    finally:
        child.kill()
        child.wait()
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["global_step"] >= 1 and bool((state["w"] == state["global_step"]).all())
    AtomicCheckpointIO().save_checkpoint({"global_step": 0}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_install_replaces_only_the_default(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert install(trainer) and isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)

    class Mine(TorchCheckpointIO):
        pass

    chosen = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        plugins=[Mine()])
    assert not install(chosen) and type(chosen.strategy.checkpoint_io) is Mine


def test_astralight_fit_trainers_write_atomically(tmp_path):
    """The CLI installs it: `astralight fit` (here without running fit) has the atomic IO."""
    from astralight.trainer.trainer_cli import AstralightCLI
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    cli = AstralightCLI(Tiny, run=False, args=["--trainer.logger=false",
                                               "--trainer.enable_progress_bar=false"])
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
