"""Shared by the slow tests that run a shipped example as a user does: its recipe shortened to a
few versions, ``astralight run`` in a subprocess, the run's summary, and the check that every
stored sample holds its own task's conversation only.

Examples whose ``prepare`` step is the same (the same function and arguments: the calculator
toy's 800-step warm start serves examples/openai_agent, agents/team and agents/openai_agents_sdk)
build it once per test session; each run folder gets hard links to it, which the launcher reuses
as it reuses any prepared ``models/init`` (minutes of CI saved per example after the first)."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
_WARM_STARTS: dict[str, Path] = {}  # the prepare section, as JSON -> its models/init


def short_recipe(example: Path, tmp_path: Path, versions: int, name: str = "recipe.yaml",
                 eval_size: int | None = None, eval_k: int | None = None) -> Path:
    """``example/name`` with ``versions`` versions (every trainer's ``max_steps`` too), one
    evaluation at the end besides version 0 (of ``eval_size`` prompts x ``eval_k`` samples when
    given: a smaller eval than the example's own costs CI less), and its ``pythonpath`` made
    absolute, written to ``tmp_path``. ``extends`` is resolved first."""
    from astralight.launch.recipe import load_recipe

    recipe = load_recipe(example / name)
    recipe["stop"]["versions"] = versions
    for trainer in recipe["trainers"]:
        trainer["trainer"]["max_steps"] = versions
    recipe["dataflow"]["eval"]["every"] = versions
    if eval_size is not None:
        recipe["dataflow"]["eval"]["source"]["init_args"]["eval_size"] = eval_size
    if eval_k is not None:
        recipe["dataflow"]["eval"]["k"] = eval_k
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def shared_warm_start(recipe: dict) -> Path | None:
    """The recipe's prepared ``models/init``, built on first use in this session (None: the
    recipe has no ``prepare`` step)."""
    from astralight.launch import prepare_initial_model
    from astralight.launch.recipe import substitute

    if not recipe.get("prepare"):
        return None
    key = json.dumps(recipe["prepare"], sort_keys=True)
    if key not in _WARM_STARTS:
        folder = Path(tempfile.mkdtemp(prefix="astralight-warm-start-"))
        atexit.register(shutil.rmtree, folder, True)
        prepare_initial_model(substitute(recipe, {"run_dir": folder,
                                                  "seed": recipe.get("seed", 0)}), folder)
        _WARM_STARTS[key] = folder / "models" / "init"
    return _WARM_STARTS[key]


def launch(recipe: Path, run_dir: Path, timeout_s: float = 5400,
           share_warm_start: bool = True) -> subprocess.CompletedProcess:
    """``astralight run`` on ``recipe`` (with the session's shared warm start in
    ``run_dir/models/init`` when ``share_warm_start``), to its end."""
    if share_warm_start:
        init = shared_warm_start(yaml.safe_load(recipe.read_text()))
        if init is not None:
            # hard links (the session's temporary folder and tmp_path share a file system)
            shutil.copytree(init, run_dir / "models" / "init", copy_function=os.link)
    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", "--run-dir",
                           str(run_dir), str(recipe)],
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    print(proc.stdout[-3000:])
    return proc


def run_example(recipe: Path, run_dir: Path, timeout_s: float = 5400,
                share_warm_start: bool = True) -> dict:
    """:func:`launch`; asserts exit 0 and returns ``summary.json``."""
    proc = launch(recipe, run_dir, timeout_s, share_warm_start)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


SUM = r"\d+\+\d+="  # a calculator task's prompt ("123+456=")


def stored_samples(run_dir: Path, versions: int, limit: int) -> tuple[Any, list]:
    """The run's tokenizer and up to ``limit`` of its stored samples (the newest versions'),
    each checked to hold its own task's conversation only: the one sum in its tokens is its
    task's prompt, so no sample carries another episode's calls (issue 39)."""
    from transformers import AutoTokenizer

    from astralight.protocol import decode
    from astralight.report.viewer import ViewerCaps, load_rollouts

    tok = AutoTokenizer.from_pretrained(run_dir / "models" / "init")
    db = run_dir / "dataflow" / "dataflow.db"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        prompts = {tid: decode(bytes(p)).prompt
                   for tid, p in conn.execute("SELECT task_id, payload FROM tasks")}
    stored = [s.sample for s in load_rollouts(db, ViewerCaps(versions=versions + 1,
                                                             samples=limit)).samples]
    assert stored, f"no stored sample in {db}"
    for s in stored:
        text = tok.decode(s.token_ids.tolist())
        assert set(re.findall(SUM, text)) == {prompts[s.task_id]}, (s.model_id, text)
    return tok, stored


def masked_tool_results(tok, stored: list) -> list[str]:
    """The masked text after the prompt of every stored single-segment episode that called a
    tool and ended with an answer, each checked to hold its tool results (``<tool_response>``)
    masked and none trained; asserts there is at least one such episode. An episode whose agent
    failed (``end`` ``error``, e.g. the SDK refusing a call's unreadable arguments before running
    the tool) is stored with ``failed_reward`` and may hold a call with no result after it."""
    import numpy as np

    with_tools = [s for s in stored if s.metadata.get("tool_calls", 0) > 0
                  and s.metadata.get("segments") == 1 and s.metadata.get("end") == "answer"]
    assert with_tools, "no stored episode called the add tool"
    out = []
    for s in with_tools:
        mask = s.loss_mask.astype(bool)
        after_prompt = np.arange(s.num_tokens) >= s.prompt_len
        masked = tok.decode(s.token_ids[~mask & after_prompt].tolist())
        assert "<tool_response>" in masked
        assert "<tool_response>" not in tok.decode(s.token_ids[mask].tolist())
        out.append(masked)
    return out
