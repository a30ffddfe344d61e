"""Atomic distributed checkpoints under FSDP2 (:mod:`astralight.trainer.fsdp2_strategy`).

Lightning's ``ModelParallelStrategy`` writes ``last.ckpt/`` in place; ``FSDP2Strategy`` writes a
new folder and swaps a ``last.ckpt`` link to it. Checked with real ``Trainer.fit`` runs of the
policy on the tiny model (CPU, gloo): resume through the link, one folder left per name, and a
save killed half-way (the shard writer raising after writing part of the folder) leaves
``last.ckpt`` pointing at the previous complete checkpoint, which a new trainer resumes from.
The link swap itself is checked on plain folders.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from astralight.trainer.checkpoint_io import install
from astralight.trainer.fsdp2_strategy import FOLDER_INFIX, FSDP2Strategy, point_link
from astralight.policy import M2POPolicy
from tests.integration.fsdp2_helpers import _identity


def _folders(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if FOLDER_INFIX in p.name)


class StartStep(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def fit(model_dir, data, root: Path, steps: int, ckpt_path=None, strategy=None):
    start = StartStep()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy or FSDP2Strategy(),
                         max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         callbacks=[start, ModelCheckpoint(dirpath=root / "ckpt", save_last=True,
                                                           every_n_train_steps=1, save_top_k=0)])
    trainer.start_step = start
    install(trainer)
    policy = M2POPolicy(str(model_dir), lr=1e-3, micro_batch_size=2)
    trainer.fit(policy, train_dataloaders=DataLoader(data * steps, batch_size=None,
                                                     collate_fn=_identity), ckpt_path=ckpt_path)
    return trainer, policy


def test_last_is_a_link_to_one_whole_folder_and_resumes(tiny_model_dir, batches, tmp_path,
                                                        clean_dist):
    trainer, _ = fit(tiny_model_dir, batches[:1], tmp_path, steps=2)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_symlink() and not os.path.isabs(os.readlink(last))  # relative: runs can move
    assert (last / "meta.pt").is_file()
    assert _folders(tmp_path / "ckpt") == [os.readlink(last)]  # the step-1 folder is gone
    trainer, _ = fit(tiny_model_dir, batches[:1], tmp_path, steps=4, ckpt_path="last")
    assert trainer.start_step.step == 2 and trainer.global_step == 4
    assert _folders(tmp_path / "ckpt") == [os.readlink(last)]


def test_a_plain_model_parallel_strategy_is_upgraded(tiny_model_dir, batches, tmp_path,
                                                     clean_dist):
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer, _ = fit(tiny_model_dir, batches[:1], tmp_path, steps=1,
                     strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    assert type(trainer.strategy) is FSDP2Strategy
    assert (tmp_path / "ckpt" / "last.ckpt").is_symlink()


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tiny_model_dir, batches, tmp_path,
                                                               clean_dist, monkeypatch):
    import lightning.pytorch.strategies.model_parallel as mp

    trainer, policy = fit(tiny_model_dir, batches[:1], tmp_path, steps=2)
    last = tmp_path / "ckpt" / "last.ckpt"
    good = os.readlink(last)
    real_save = mp._distributed_checkpoint_save

    def killed_half_way(state, path):
        Path(path, "__0_0.distcp").write_bytes(b"half a shard")  # what a kill leaves behind
        raise KeyboardInterrupt("killed during the save")

    monkeypatch.setattr(mp, "_distributed_checkpoint_save", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(last)
    monkeypatch.setattr(mp, "_distributed_checkpoint_save", real_save)
    assert os.readlink(last) == good and (last / "meta.pt").is_file()
    assert len(_folders(tmp_path / "ckpt")) == 2  # the partial folder, not pointed at

    resumed, _ = fit(tiny_model_dir, batches[:1], tmp_path, steps=3, ckpt_path="last")
    assert resumed.start_step.step == 2 and resumed.global_step == 3  # the previous checkpoint
    assert _folders(tmp_path / "ckpt") == [os.readlink(last)]  # the partial one was removed


def test_point_link_replaces_atomically_and_cleans_up(tmp_path):
    link = tmp_path / "last.ckpt"
    link.mkdir()  # a folder written in place before (plain ModelParallelStrategy)
    (link / "meta.pt").write_bytes(b"old")
    first = tmp_path / f"last.ckpt{FOLDER_INFIX}a"
    first.mkdir()
    (first / "meta.pt").write_bytes(b"v1")
    point_link(link, first)
    assert link.is_symlink() and (link / "meta.pt").read_bytes() == b"v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", first.name]
    torn = tmp_path / f"last.ckpt{FOLDER_INFIX}torn"
    torn.mkdir()
    second = tmp_path / f"last.ckpt{FOLDER_INFIX}b"
    second.mkdir()
    (second / "meta.pt").write_bytes(b"v2")
    other = tmp_path / f"epoch=0.ckpt{FOLDER_INFIX}c"  # another checkpoint name: untouched
    other.mkdir()
    point_link(link, second)
    assert (link / "meta.pt").read_bytes() == b"v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["last.ckpt", second.name, other.name])


def test_remove_checkpoint_removes_link_and_folder(tmp_path):
    folder = tmp_path / f"step=1.ckpt{FOLDER_INFIX}x"
    folder.mkdir()
    (folder / "meta.pt").write_bytes(b"x")
    link = tmp_path / "step=1.ckpt"
    point_link(link, folder)
    strategy = FSDP2Strategy()
    strategy.remove_checkpoint(link)
    assert list(tmp_path.iterdir()) == []  # (no process group needed to remove files)
