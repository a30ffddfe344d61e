"""``astralight export``: real trainer checkpoints (``Trainer.fit`` of ``M2POPolicy`` on the tiny
model, CPU) turned into Hugging Face folders, loaded back with transformers and peft.

- a single-file ``last.ckpt`` -> fp32 export (through ``python -m astralight.cli export``) has
  exactly the trained weights, not the base's, and the tokenizer; the bf16 export is the bf16 cast;
- an FSDP2 distributed-checkpoint folder (one rank, gloo, via its ``last.ckpt`` link; tied
  embeddings) -> the trained weights, with no optimizer entry ever read from disk;
- a LoRA policy -> a peft adapter folder with the trained adapter values; ``--merge-lora`` -> the
  merged full model;
- errors: a missing base folder names ``--model-path``, a non-empty ``--out`` needs ``--force``,
  a random file, a folder, no ``model.`` keys, missing keys, an unknown dtype; a failed export
  leaves no ``--out`` folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from astralight.trainer.checkpoint_io import install
from astralight.cli import main as cli_main
from astralight.trainer.export import ExportError, export_checkpoint, read_checkpoint
from astralight.policy import M2POPolicy
from tests.integration.fsdp2_helpers import _full_state, _identity

ROOT = Path(__file__).resolve().parents[2]
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
PROMPT = "37+45="


def _fit(model_dir, data, root: Path, strategy="auto", **kwargs):
    """A real ``Trainer.fit`` (one step per batch, a checkpoint after each, as ``astralight fit``
    installs them); returns the policy and its ``last.ckpt``."""
    policy = M2POPolicy(str(model_dir), lr=1e-2, **kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=len(data),
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root,
                         callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_last=True,
                                                    every_n_train_steps=1, save_top_k=0)])
    install(trainer)
    trainer.fit(policy, train_dataloaders=DataLoader(data, batch_size=None, collate_fn=_identity))
    return policy, root / "ckpt" / "last.ckpt"


def _load(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, batches, tmp_path_factory):
    policy, ckpt = _fit(tiny_model_dir, batches, tmp_path_factory.mktemp("full"))
    return _full_state(policy), ckpt


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, batches, tmp_path_factory):
    policy, ckpt = _fit(tiny_model_dir, batches, tmp_path_factory.mktemp("lora"), lora=LORA)
    return policy, ckpt


def test_single_file_checkpoint_exports_the_trained_weights(tiny_model_dir, full_run, tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    trained, ckpt = full_run
    assert ckpt.is_file()
    out = tmp_path / "fp32"
    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "export", str(ckpt), "--out",
                           str(out), "--dtype", "float32"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("export: ")]
    assert lines[0].startswith("export: reading ")
    assert "writing the full model (float32)" in lines[2]
    assert lines[-1].startswith(f"export: done: {len(trained)} tensors, ")
    assert "float32" in lines[-1] and str(out) in lines[-1]

    got = _load(out).state_dict()
    base = _load(tiny_model_dir).state_dict()
    assert set(got) == set(trained)
    for name, w in trained.items():
        assert torch.equal(got[name], w), name
    assert sum(not torch.equal(base[n], w) for n, w in trained.items()) >= len(trained) // 2
    assert not any(p.name.startswith(f"{out.name}.tmp-") for p in tmp_path.iterdir())
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask, modes  # transformers writes it 0600
    assert set(modes.values()) == {0o666 & ~umask}, modes

    bf16 = export_checkpoint(ckpt, tmp_path / "bf16", log=lambda line: None)  # the default dtype
    assert bf16.kind == "full" and bf16.dtype == torch.bfloat16 and bf16.tensors == len(trained)
    assert bf16.bytes == sum(w.numel() * 2 for w in trained.values())
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    model = _load(tmp_path / "bf16", dtype=torch.bfloat16)
    assert model.config.dtype == torch.bfloat16
    for name, w in model.state_dict().items():
        assert torch.equal(w, trained[name].to(torch.bfloat16)), name

    want = AutoTokenizer.from_pretrained(tiny_model_dir)
    for folder in (out, tmp_path / "bf16"):
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok(PROMPT)["input_ids"] == want(PROMPT)["input_ids"] and tok.eos_token_id == 1
        assert (folder / "generation_config.json").read_text() == (
            tiny_model_dir / "generation_config.json").read_text()


def test_fsdp2_folder_exports_without_reading_the_optimizer(batches, tmp_path, clean_dist,
                                                            monkeypatch):
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    from astralight.trainer.fsdp2_strategy import FSDP2Strategy
    from astralight.trainer.tinymodel import TinyModelSpec, build_model, build_tokenizer, save_model_folder

    tied_dir = save_model_folder(build_model(TinyModelSpec(tie_word_embeddings=True)),
                                 build_tokenizer(), tmp_path / "tied")
    policy, link = _fit(tied_dir, batches, tmp_path / "run", strategy=FSDP2Strategy())
    trained = _full_state(policy)
    assert link.is_symlink() and (link / ".metadata").is_file() and (link / "meta.pt").is_file()
    entries = FileSystemReader(link).read_metadata().state_dict_metadata
    optim = [k for k in entries if k.startswith("optimizer_0.")]
    assert optim  # AdamW's moments are in the folder...

    read: list[str] = []
    real_read = FileSystemReader.read_data

    def recording(self, plan, planner):
        read.extend(item.storage_index.fqn for item in plan.items)
        return real_read(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", recording)
    result = export_checkpoint(link, tmp_path / "out", dtype="float32", log=lambda line: None)
    monkeypatch.undo()
    # ...but only the model's entries were read, each once
    model_entries = sorted(k for k in entries if k.startswith("state_dict.model."))
    assert sorted(set(read)) == model_entries and not any(k.startswith("optimizer") for k in read)
    assert sorted(result.checkpoint.read_keys) == sorted(read)
    assert result.checkpoint.kind == "dcp"

    got = _load(tmp_path / "out")
    assert got.config.tie_word_embeddings
    assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # stored once, as transformers stores it
    state = got.state_dict()
    initial = _load(tied_dir).state_dict()
    assert set(state) == set(trained)
    for name, w in trained.items():
        assert torch.equal(state[name], w), name
    assert not torch.equal(state["model.embed_tokens.weight"],
                           initial["model.embed_tokens.weight"])


def test_lora_policy_exports_a_peft_adapter_and_a_merged_model(tiny_model_dir, lora_run,
                                                               tmp_path):
    import json

    from peft import PeftModel

    policy, ckpt = lora_run
    trained = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    lora_b = [k for k in trained if ".lora_B." in k]
    assert lora_b and all(bool(trained[k].abs().sum() > 0) for k in lora_b)  # B moved off 0

    result = export_checkpoint(ckpt, tmp_path / "adapter", dtype="float32", log=lambda line: None)
    assert result.kind == "adapter"
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert all(".lora_" in k for k in result.checkpoint.state)  # the base weights not even read
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        4, 8.0, ["q_proj", "v_proj"])
    loaded = PeftModel.from_pretrained(_load(tiny_model_dir), tmp_path / "adapter")
    got = loaded.state_dict()
    adapters = [k for k in trained if ".lora_" in k]
    assert len(adapters) == result.tensors == 8
    for name in adapters:
        assert torch.equal(got[name], trained[name]), name

    merged = export_checkpoint(ckpt, tmp_path / "merged", dtype="float32", merge_lora=True,
                               log=lambda line: None)
    assert merged.kind == "merged"
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    want = loaded.merge_and_unload().state_dict()
    got = _load(tmp_path / "merged").state_dict()
    base = _load(tiny_model_dir).state_dict()
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-6, atol=1e-7, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], base[q])  # the adapter is in
    up = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(got[up], base[up])  # not adapted: the base weight


def _cli(capsys, *args) -> tuple[int, str]:
    rc = cli_main(["export", *map(str, args)])
    captured = capsys.readouterr()
    return rc, captured.err


def test_cli_errors_name_the_fix(tiny_model_dir, full_run, tmp_path, capsys):
    _, ckpt = full_run
    # a run that moved: the checkpoint's model_path is gone
    moved = torch.load(ckpt, weights_only=True)
    moved["hyper_parameters"]["model_path"] = str(tmp_path / "gone" / "model")
    moved_ckpt = tmp_path / "moved.ckpt"
    torch.save(moved, moved_ckpt)
    rc, err = _cli(capsys, moved_ckpt, "--out", tmp_path / "a")
    assert rc == 2 and "--model-path" in err and "gone" in err and "does not exist" in err
    assert not (tmp_path / "a").exists()
    rc, err = _cli(capsys, ckpt, "--out", tmp_path / "a", "--model-path", tmp_path / "nowhere")
    assert rc == 2 and "--model-path" in err and "nowhere" in err
    assert _cli(capsys, moved_ckpt, "--out", tmp_path / "a", "--model-path", tiny_model_dir)[0] == 0
    assert (tmp_path / "a" / "model.safetensors").is_file()

    # a non-empty --out needs --force, which replaces it whole
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = _cli(capsys, ckpt, "--out", out)
    assert rc == 2 and "--force" in err and (out / "keep.txt").read_text() == "mine"
    assert _cli(capsys, ckpt, "--out", out, "--force")[0] == 0
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("busy")) == ["busy"]
    rc, err = _cli(capsys, ckpt, "--out", tiny_model_dir, "--force")  # never the base itself
    assert rc == 2 and "base model" in err and (tiny_model_dir / "model.safetensors").is_file()

    # not checkpoints
    junk = tmp_path / "random.bin"
    junk.write_bytes(os.urandom(4096))
    rc, err = _cli(capsys, junk, "--out", tmp_path / "b")
    assert rc == 2 and "not a Lightning checkpoint" in err and "random.bin" in err
    rc, err = _cli(capsys, ckpt.parent.parent, "--out", tmp_path / "b")
    assert rc == 2 and "a folder without .metadata" in err
    rc, err = _cli(capsys, tmp_path / "absent.ckpt", "--out", tmp_path / "b")
    assert rc == 2 and "no such file" in err
    no_model = tmp_path / "no_model.ckpt"
    torch.save({"state_dict": {"net.weight": torch.ones(2)}, "hyper_parameters": {}}, no_model)
    rc, err = _cli(capsys, no_model, "--out", tmp_path / "b", "--model-path", tiny_model_dir)
    assert rc == 2 and "no tensors under 'model.'" in err and "net.weight" in err
    rc, err = _cli(capsys, ckpt, "--out", tmp_path / "b", "--dtype", "int8")
    assert rc == 2 and "--dtype" in err and "int8" in err
    rc, err = _cli(capsys, ckpt, "--out", tmp_path / "b", "--merge-lora")
    assert rc == 2 and "--merge-lora" in err

    # a checkpoint that lacks weights of the base config: named
    partial = torch.load(ckpt, weights_only=True)
    del partial["state_dict"]["model.model.norm.weight"]
    del partial["state_dict"]["model.lm_head.weight"]
    torch.save(partial, tmp_path / "partial.ckpt")
    rc, err = _cli(capsys, tmp_path / "partial.ckpt", "--out", tmp_path / "b")
    assert rc == 2 and "missing 2" in err and "model.norm.weight" in err and "lm_head.weight" in err
    assert not (tmp_path / "b").exists()
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


def test_a_failed_write_leaves_no_out_folder(full_run, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    _, ckpt = full_run

    def killed(self, path, *args, **kwargs):
        Path(path, "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(ckpt, tmp_path / "out", log=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_read_checkpoint_api_selects_tensors(full_run):
    _, ckpt = full_run
    probe = read_checkpoint(ckpt, keep=lambda name: name.startswith("lm_head"),
                            log=lambda line: None)
    assert probe.kind == "file" and list(probe.state) == ["lm_head.weight"]
    assert "model.norm.weight" in probe.model_keys and probe.hparams["lr"] == 1e-2
    with pytest.raises(ExportError, match="--dtype"):
        export_checkpoint(ckpt, "unused", dtype="int4")
