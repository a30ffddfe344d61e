"""``astralight export``: a trainer checkpoint as a folder that transformers, vLLM and peft load.

    astralight export CKPT --out DIR [--model-path BASE_HF_DIR] [--dtype bfloat16|float32|float16]
                      [--merge-lora] [--force]

Why: ``astralight fit`` writes Lightning checkpoints -- one file (``last.ckpt``: single device,
DDP) or, under FSDP2 (:class:`astralight.trainer.fsdp2_strategy.FSDP2Strategy`), a
``torch.distributed.checkpoint`` (DCP) folder reached through a ``last.ckpt`` link, with the
model and AdamW shards in ``*.distcp`` files and everything else (``hyper_parameters``, loops,
callbacks) in ``meta.pt``. Neither is something a server or ``from_pretrained`` reads. This
command turns one into:

* a full model folder (``config.json``, ``model.safetensors`` -- written by transformers'
  ``save_pretrained``, so tied embeddings are stored once and large models are sharded as
  transformers shards them -- plus the tokenizer, ``generation_config.json`` and every other
  non-weight file copied from the base folder) in ``--dtype`` (default bfloat16, what the RaaS
  serves);
* for a LoRA policy, the peft adapter folder (``adapter_config.json`` and
  ``adapter_model.safetensors``, named as ``PeftModel.save_pretrained`` names them, see
  :mod:`astralight.trainer.lora`), or with ``--merge-lora`` the full model with ``W + B @ A * scaling``
  merged in (float32 arithmetic, then cast).

What it reads. The policy's ``hyper_parameters`` say which base model (``model_path``;
``--model-path`` overrides it when the run has moved) and whether it is LoRA (``lora``). Only
the LightningModule state under ``model.`` (``RLPolicy`` keeps the HF model at ``self.model``)
is read: a checkpoint file is opened with ``torch.load(mmap=True)`` so the optimizer tensors are
never paged in; a DCP folder is loaded without a process group (``no_dist=True``) into a
template built from its ``.metadata`` for those keys only (an adapter export reads only the
adapter tensors), so no optimizer shard is ever read. The model's layout comes from the base
folder's ``config.json`` (built on the meta device: no base weights are loaded), against which
the checkpoint's names and shapes are checked.

Nothing half-written is left under ``DIR``: the export goes to ``DIR.tmp-<pid>-<hex>`` next to
it and is renamed into place at the end (a killed export leaves only that temp folder, safe to
delete). A non-empty ``DIR`` is replaced only with ``--force``; the base folder and the
checkpoint can never be the ``--out`` folder.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import time
import uuid
import warnings
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from astralight.trainer.fsdp2 import tied_aliases
from astralight.trainer.lora import PEFT_PREFIX, LoraSpec

__all__ = ["DTYPES", "CheckpointState", "ExportError", "ExportResult", "export_checkpoint",
           "main", "parse_dtype", "read_checkpoint"]

#: accepted ``--dtype`` values (and short aliases)
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
#: the LightningModule attribute that holds the HF model (``RLPolicy.model``)
MODEL_PREFIX = "model."
#: files of a base folder that are weights (or their index): never copied into an export
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                    ".index.json", ".distcp")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class ExportError(ValueError):
    """A checkpoint, base folder or option that cannot be exported; the message names the fix."""


@dataclass
class CheckpointState:
    """What :func:`read_checkpoint` found: the HF model's tensors and the policy's settings.

    Attributes:
        kind: ``"file"`` (one ``torch.save`` file) or ``"dcp"`` (a distributed-checkpoint folder).
        path: the resolved checkpoint path (links followed).
        hparams: the LightningModule's ``hyper_parameters`` (``{}`` when the checkpoint has none).
        state: tensors under the HF model's own names (the ``model.`` prefix removed), only those
            ``keep`` selected.
        model_keys: every tensor name under ``model.`` in the checkpoint (read or not).
        read_keys: the checkpoint entries actually loaded (for a DCP folder: the load
            template's keys, e.g. ``state_dict.model.lm_head.weight``).
    """

    kind: str
    path: Path
    hparams: dict
    state: dict[str, torch.Tensor]
    model_keys: list[str]
    read_keys: list[str] = field(default_factory=list)


@dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    out: Path
    kind: str  # "full" | "adapter" | "merged"
    dtype: torch.dtype
    tensors: int
    bytes: int
    seconds: float
    base: Path
    checkpoint: CheckpointState


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (``bf16``), ``"float32"`` (``fp32``) or ``"float16"`` (``fp16``)."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        name = str(name).replace("torch.", "")
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ExportError(f"--dtype: {name!r} is not one of bfloat16, float32, float16") from None


# ---------------------------------------------------------------------------------- reading


def _clean(name: str) -> str:
    """A module name without wrapper segments (torch.compile, activation checkpointing, FSDP1)."""
    for marker in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(marker, "")
    return name


def _load(path: Path, weights_only: bool) -> Any:
    try:  # memory-mapped: a tensor's bytes are read only when it is used
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)  # legacy format


def _torch_load(path: Path, log: Callable[[str], Any]) -> Any:
    """``torch.load`` memory-mapped and weights-only. A ``torch.save`` archive whose extra state
    a weights-only load refuses (a user callback's own objects) is loaded again fully: it is the
    user's own trainer output, which Lightning itself loads that way."""
    try:
        return _load(path, True)
    except pickle.UnpicklingError as exc:
        if "weights only" not in str(exc).lower() or not zipfile.is_zipfile(path):
            raise
    log(f"export: {path.name} holds objects a weights-only load refuses; loading it fully "
        "(only export checkpoints you trust)")
    return _load(path, False)


def _not_a_checkpoint(path: Path, why: str) -> ExportError:
    return ExportError(f"CKPT {path}: not a Lightning checkpoint ({why}); pass a checkpoint file "
                       "(e.g. RUN/checkpoints/policy/last.ckpt) or a distributed-checkpoint "
                       "folder (FSDP2's last.ckpt link, holding .metadata and meta.pt)")


def _read_file(path: Path, keep: Callable[[str], bool], log) -> CheckpointState:
    try:
        ckpt = _torch_load(path, log)
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle means "not a checkpoint"
        first = (str(exc).splitlines() or [""])[0][:200]
        raise _not_a_checkpoint(path, f"torch.load failed: {type(exc).__name__}: {first}") from exc
    if not isinstance(ckpt, Mapping) or not isinstance(ckpt.get("state_dict"), Mapping):
        what = list(ckpt)[:8] if isinstance(ckpt, Mapping) else type(ckpt).__name__
        raise _not_a_checkpoint(path, f"no 'state_dict' mapping; found {what}")
    hparams = dict(ckpt.get("hyper_parameters") or {})
    model_keys, state, read = [], {}, []
    for key, value in ckpt["state_dict"].items():
        if not key.startswith(MODEL_PREFIX) or not torch.is_tensor(value):
            continue
        name = _clean(key[len(MODEL_PREFIX):])
        model_keys.append(name)
        if keep(name):
            state[name] = value
            read.append(key)
    _require_model_keys(path, model_keys, list(ckpt["state_dict"]))
    return CheckpointState("file", path, hparams, state, model_keys, read)


def _recording_reader(path: Path):
    """A ``FileSystemReader`` that records every entry it reads (``read_fqns``): the record
    behind :attr:`CheckpointState.read_keys`, which shows that no optimizer shard was read."""
    from torch.distributed.checkpoint import FileSystemReader

    class RecordingReader(FileSystemReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.read_fqns: list[str] = []

        def read_data(self, plan, planner):
            self.read_fqns.extend(item.storage_index.fqn for item in plan.items)
            return super().read_data(plan, planner)

    return RecordingReader(path)


def _read_dcp(path: Path, keep: Callable[[str], bool], log) -> CheckpointState:
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _recording_reader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # noqa: BLE001
        raise _not_a_checkpoint(path, f"its .metadata does not load: {exc}") from exc
    hparams: dict = {}
    meta_pt = path / "meta.pt"
    if meta_pt.is_file():
        meta = _torch_load(meta_pt, log)
        if isinstance(meta, Mapping):
            hparams = dict(meta.get("hyper_parameters") or {})
    # Lightning saves {"state_dict": module state, "optimizer_0": ...}; DCP flattens it to
    # "state_dict.model.…" and remembers each key's path in planner_data.
    paths = dict(metadata.planner_data or {})
    template: dict[str, dict[str, torch.Tensor]] = {}
    model_keys, names = [], {}
    for fqn, md in metadata.state_dict_metadata.items():
        where = paths.get(fqn)
        if where is None:  # not flattened by path: "state_dict.<module key>"
            head, _, tail = fqn.partition(".")
            where = (head, tail)
        if (len(where) != 2 or where[0] != "state_dict"
                or not str(where[1]).startswith(MODEL_PREFIX)
                or not isinstance(md, TensorStorageMetadata)):
            continue
        name = _clean(str(where[1])[len(MODEL_PREFIX):])
        model_keys.append(name)
        if keep(name):
            template.setdefault("state_dict", {})[str(where[1])] = torch.empty(
                md.size, dtype=md.properties.dtype)
            names[str(where[1])] = name
    _require_model_keys(path, model_keys, list(metadata.state_dict_metadata))
    if template:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load(template, storage_reader=reader, no_dist=True)
    state = {names[k]: v for k, v in template.get("state_dict", {}).items()}
    return CheckpointState("dcp", path, hparams, state, model_keys, list(reader.read_fqns))


def _require_model_keys(path: Path, model_keys: list[str], all_keys: list[str]) -> None:
    if not model_keys:
        raise ExportError(
            f"CKPT {path}: no tensors under 'model.' in its state_dict (first keys: "
            f"{all_keys[:5]}); export reads the Hugging Face model a LightningModule keeps at "
            "self.model, as astralight.policy.RLPolicy does")


def read_checkpoint(ckpt: str | os.PathLike, keep: Callable[[str], bool] | None = None,
                    log: Callable[[str], Any] = print) -> CheckpointState:
    """The HF model tensors (names without ``model.``) and ``hyper_parameters`` of a Lightning
    checkpoint file or DCP folder (or a link to either). ``keep(name)`` selects which tensors
    are loaded (default all); the optimizer state is never loaded."""
    keep = keep or (lambda name: True)
    given = Path(ckpt)
    if not given.exists():
        raise ExportError(f"CKPT {given}: no such file or folder"
                          + (" (a broken link)" if given.is_symlink() else ""))
    path = given.resolve()
    if path.is_dir():
        if (path / ".metadata").is_file():
            return _read_dcp(path, keep, log)
        inner = path / "last.ckpt"
        hint = f"; did you mean {given / 'last.ckpt'}?" if inner.exists() else ""
        raise _not_a_checkpoint(given, f"a folder without .metadata{hint}")
    return _read_file(path, keep, log)


# ---------------------------------------------------------------------------------- the model


def _resolve_base(model_path: str | None, hparams: Mapping) -> Path:
    raw = model_path if model_path is not None else hparams.get("model_path")
    if not raw:
        raise ExportError("--model-path: the checkpoint's hyper_parameters name no model_path; "
                          "pass --model-path BASE_HF_DIR (the Hugging Face folder the run "
                          "started from)")
    base = Path(str(raw)).expanduser()
    source = "--model-path" if model_path is not None else "the checkpoint's model_path"
    if not (base / "config.json").is_file():
        what = "has no config.json" if base.is_dir() else "does not exist"
        raise ExportError(f"--model-path: the base model folder {base} ({source}) {what}; pass "
                          "--model-path BASE_HF_DIR with the Hugging Face folder the run started "
                          "from (it may have moved)")
    return base.resolve()


def _meta_model(base: Path):
    """The base config's causal LM on the meta device: names, shapes and tying, no weights."""
    from transformers import AutoConfig

    from astralight.trainer.hf_models import causal_lm_on_meta

    return causal_lm_on_meta(AutoConfig.from_pretrained(base))


def _lora_spec(hparams: Mapping, model_keys: list[str], ckpt: Path) -> LoraSpec | None:
    spec = LoraSpec.from_config(hparams.get("lora"))
    peft_keys = any(k.startswith(PEFT_PREFIX) for k in model_keys)
    if spec is not None and not peft_keys:
        raise ExportError(f"CKPT {ckpt}: hyper_parameters.lora is set but the checkpoint holds no "
                          f"peft model (no '{PEFT_PREFIX}' names under 'model.')")
    if spec is None and peft_keys:
        raise ExportError(f"CKPT {ckpt}: the checkpoint holds a peft (LoRA) model but its "
                          "hyper_parameters have no 'lora' spec to rebuild the adapter config from")
    return spec


def _few(names, n: int = 5) -> str:
    names = sorted(names)
    more = f" … and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _check_names(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                 base: Path, optional: set[str] = frozenset()) -> None:
    """Refuse a checkpoint whose names or shapes do not match the base config's model."""
    missing = set(expected) - set(state) - set(optional)
    unexpected = set(state) - set(expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} ({_few(missing)})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} ({_few(unexpected)})")
        raise ExportError(f"the checkpoint's model does not match the base config {base}/"
                          f"config.json: {'; '.join(parts)}. Is --model-path the folder this "
                          "policy was trained from?")
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in state.items()
             if tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise ExportError(f"the checkpoint's tensor shapes do not match the base config "
                          f"{base}/config.json: {_few(wrong, 3)}")


# ---------------------------------------------------------------------------------- writing


def _prepare_out(out: Path, force: bool, protected: list[Path]) -> None:
    resolved = out.resolve()
    for p in protected:
        if resolved == p or resolved in p.parents:
            raise ExportError(f"--out: {out} would replace {p} (the base model or the checkpoint); "
                              "choose another folder")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ExportError(f"--out: {out} exists and is not a folder")
        if any(out.iterdir()) and not force:
            raise ExportError(f"--out: {out} is not empty; pass --force to replace it")


def plain_file_modes(folder: Path) -> None:
    """Give every file of ``folder`` the mode a plain write would (``0o666`` less the umask):
    transformers writes ``model.safetensors`` through a private temporary file, 0600, which
    another user serving the export (a vLLM container, a colleague) could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` folder to ``out``, replacing what is there."""
    if out.is_symlink():
        out.unlink()
    if out.exists():
        aside = out.with_name(f"{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, aside)
        os.rename(tmp, out)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, out)


def _copy_side_files(base: Path, dest: Path, skip: set[str]) -> list[str]:
    """Copy the base folder's top-level non-weight files (tokenizer, generation config, chat
    template, licence...) into ``dest``, except names in ``skip``."""
    copied = []
    for src in sorted(base.iterdir()):
        name = src.name
        if (not src.is_file() or name.startswith(".") or name in skip
                or name.endswith(_WEIGHT_SUFFIXES)):
            continue
        shutil.copy2(src, dest / name)
        copied.append(name)
    return copied


def _write_full(state: dict[str, torch.Tensor], model, base: Path, dest: Path,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``save_pretrained`` of ``model`` (meta) with ``state`` assigned; the side files after."""
    state = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise ExportError(f"the checkpoint does not fit the base config {base}/config.json: "
                          f"{exc}") from exc
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # lm_head shares the embedding again, as from_pretrained does
    from astralight.trainer.hf_models import tie_if_configured

    tie_if_configured(model)  # (if transformers' tying is off in this process)
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if on_meta:
        raise ExportError(f"the checkpoint lacks {len(on_meta)} weights of the base config "
                          f"{base}/config.json ({_few(on_meta)})")
    model.config.dtype = dtype
    model.save_pretrained(dest)
    _copy_side_files(base, dest, skip={"config.json"})
    written, seen = {}, set()
    for name, param in model.state_dict().items():  # persistent tensors, a tied one once
        key = (param.data_ptr(), tuple(param.shape)) if not param.is_meta else None
        if key is not None and key not in seen:
            seen.add(key)
            written[name] = param
    return written


def _write_adapter(state: dict[str, torch.Tensor], peft_model, base: Path, dest: Path,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    from astralight.trainer.lora import adapter_config, adapter_state_dict

    tensors = {k: v.detach().to(dtype).contiguous()
               for k, v in adapter_state_dict(peft_model, state).items()}
    if not tensors:
        raise ExportError("the checkpoint holds no adapter tensors (names with .lora_A / .lora_B)")
    config = adapter_config(peft_model)
    config["base_model_name_or_path"] = str(base)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(dest / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return tensors


# ---------------------------------------------------------------------------------- export


def export_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike,
                      model_path: str | os.PathLike | None = None,
                      dtype: str | torch.dtype = "bfloat16", merge_lora: bool = False,
                      force: bool = False, log: Callable[[str], Any] = print) -> ExportResult:
    """Export the checkpoint ``ckpt`` into the folder ``out`` (see the module docstring).

    Raises :class:`ExportError` with a message naming the option or the problem.
    """
    t0 = time.perf_counter()
    torch_dtype = parse_dtype(dtype)
    out = Path(out)
    ckpt_path = Path(ckpt)
    protected = [ckpt_path.resolve()] if ckpt_path.exists() else []
    if model_path is not None:
        protected.append(Path(model_path).resolve())
    _prepare_out(out, force, protected)

    # what to read is known only after the hyper-parameters; a first cheap pass gets those
    # (single file: an mmap load; DCP: .metadata and meta.pt), then the tensors are selected.
    log(f"export: reading {ckpt_path}")
    probe = read_checkpoint(ckpt_path, keep=lambda name: False, log=log)
    base = _resolve_base(None if model_path is None else str(model_path), probe.hparams)
    _prepare_out(out, force, protected + [base])
    spec = _lora_spec(probe.hparams, probe.model_keys, probe.path)
    if merge_lora and spec is None:
        raise ExportError("--merge-lora: the checkpoint's policy has no LoRA adapter to merge "
                          "(drop --merge-lora to export the full model)")
    kind = "full" if spec is None else ("merged" if merge_lora else "adapter")
    model = _meta_model(base)
    if spec is not None:
        from astralight.trainer.lora import wrap_model

        model = wrap_model(model, spec)
    expected = dict(model.state_dict())
    if kind == "adapter":
        keep = lambda name: ".lora_" in name  # noqa: E731 - the adapter alone
        expected = {k: v for k, v in expected.items() if ".lora_" in k}
    else:
        keep = None
    t_read = time.perf_counter()
    source = read_checkpoint(ckpt_path, keep=keep, log=log)
    read_bytes = sum(t.numel() * t.element_size() for t in source.state.values())
    log(f"export: read {len(source.state)} model tensors ({read_bytes / 2**20:.1f} MiB) from the "
        f"{'distributed-checkpoint folder' if source.kind == 'dcp' else 'checkpoint file'} "
        f"{source.path} in {time.perf_counter() - t_read:.1f} s"
        + (f"; LoRA r={spec.r}, alpha={spec.alpha}" if spec is not None else ""))
    _check_names(source.state, expected, base, optional=tied_aliases(model))

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    what = {"full": "full model", "merged": "full model with the LoRA adapter merged",
            "adapter": "peft adapter"}[kind]
    log(f"export: writing the {what} ({str(torch_dtype).replace('torch.', '')}) to {out}")
    try:
        if kind == "adapter":
            written = _write_adapter(source.state, model, base, tmp, torch_dtype)
        else:
            state = source.state
            target = model
            if kind == "merged":
                from astralight.trainer.lora import merged_state_dict

                state = merged_state_dict(model, state)
                target = _meta_model(base)
            written = _write_full(state, target, base, tmp, torch_dtype)
        plain_file_modes(tmp)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_bytes = sum(t.numel() * t.element_size() for t in written.values())
    seconds = time.perf_counter() - t0
    log(f"export: done: {len(written)} tensors, {n_bytes} bytes ({n_bytes / 2**20:.1f} MiB), "
        f"{str(torch_dtype).replace('torch.', '')}, {seconds:.1f} s -> {out}")
    return ExportResult(out=out, kind=kind, dtype=torch_dtype, tensors=len(written),
                        bytes=n_bytes, seconds=seconds, base=base, checkpoint=source)


def main(argv: list[str] | None = None) -> int:
    """``astralight export CKPT --out DIR [...]``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="astralight export",
        description="Turn a trainer checkpoint (a Lightning .ckpt file or an FSDP2 distributed-"
                    "checkpoint folder) into a Hugging Face folder: the full model, or a LoRA "
                    "policy's peft adapter (or, with --merge-lora, the merged model).")
    parser.add_argument("ckpt", metavar="CKPT",
                        help="checkpoint file, distributed-checkpoint folder, or a link to either "
                             "(e.g. RUN/checkpoints/policy/last.ckpt)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    parser.add_argument("--model-path", default=None, metavar="BASE_HF_DIR",
                        help="the base Hugging Face folder (default: the checkpoint's model_path)")
    parser.add_argument("--dtype", default="bfloat16", metavar="DTYPE",
                        help="bfloat16 (default), float32 or float16")
    parser.add_argument("--merge-lora", action="store_true",
                        help="for a LoRA policy: write the merged full model, not the adapter")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        export_checkpoint(args.ckpt, args.out, model_path=args.model_path, dtype=args.dtype,
                          merge_lora=args.merge_lora, force=args.force, log=log)
    except ExportError as exc:
        print(f"astralight export: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
