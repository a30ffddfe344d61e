"""The rollout viewer's page in a real browser: headless Chromium renders ``viewer.html`` of a run
folder whose dataflow state the real dataflow core wrote (two policies, tool episodes, a
completion holding markup that would run if it were not escaped).

- ``--screenshot``: a non-trivial PNG (size, many distinct colours, no colour covering nearly
  all of it);
- ``--dump-dom``: the page's script ran (it passed the page's Content-Security-Policy, whose
  script hash it must match), filled the sample counts in, applied filters given in the
  address's ``#fragment`` (policy, tool error, reward), and the model's ``<script>`` / ``onerror``
  never ran.

Chromium: ``chromium`` (or ``chromium-browser`` / ``google-chrome``) on the PATH; when missing
and the test runs as root with apt-get (CI machines), it is installed with ``apt-get install -y
chromium``; when it still cannot be found the test fails saying so (never skips).

``ASTRALIGHT_VIEWER_SCREENSHOT=PATH`` also copies the screenshot there
(``docs/images/rollout-viewer.png`` is one, of a run folder named ``runs/tool-agent-...``,
quantised to 64 colours to stay small).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.protocol import Sample
from astralight.report.viewer import write_viewer
from tests.unit.dataflow_fakes import publish

pytestmark = pytest.mark.slow  # installs and starts a browser

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
POLICIES = ["solver", "verifier"]
#: what the completions would do if their markup ran: the test looks for these marks
EVIL = ("<script>document.title='PWNED'</script>"
        "<img src=x onerror=\"document.body.setAttribute('data-pwned','1')\">")

QUESTIONS = [("A box holds 3 coins. Another box holds 2 coins. How many coins in total?",
              "3 + 2", "5"),
             ("Tom has 7 apples and eats 4. How many are left?", "7 - 4", "3"),
             ("Each of 4 bags holds 6 marbles. How many marbles are there?", "4 * 6", "24")]


def chromium() -> str:
    """The browser's path; installed with apt-get when missing and we are root (CI)."""
    for name in BROWSERS:
        if shutil.which(name):
            return shutil.which(name)
    tried = "not on the PATH"
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
            if proc.returncode != 0:
                tried = f"`{' '.join(cmd)}` failed: {(proc.stdout + proc.stderr)[-1500:]}"
                break
        for name in BROWSERS:
            if shutil.which(name):
                return shutil.which(name)
    else:
        tried += " and not root with apt-get, so not installed"
    pytest.fail(f"headless Chromium is needed for this test: {tried}. Install it (Debian/Ubuntu: "
                f"`apt-get install -y chromium`) and run again.")


def browse(browser: str, profile: Path, *args: str, timeout: int = 120) -> str:
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--hide-scrollbars", "--mute-audio", f"--user-data-dir={profile}",
         *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _sample(tok, task_id, index, model_id, prompt, turns, reward, version, metadata):
    ids = tok.encode(prompt, add_special_tokens=False)
    prompt_len, mask, lps = len(ids), [0] * len(ids), [0.0] * len(ids)
    rng = np.random.default_rng(index + 17 * version)
    for kind, text in turns:
        t = tok.encode(text, add_special_tokens=False)
        ids += t
        mask += [1 if kind == "model" else 0] * len(t)
        lps += (list(-rng.exponential(0.6, len(t))) if kind == "model" else [0.0] * len(t))
    return Sample(task_id=task_id, sample_index=index, model_id=model_id,
                  token_ids=np.array(ids, np.int32), logprobs=np.array(lps, np.float32),
                  loss_mask=np.array(mask, np.uint8),
                  versions=np.array([version if m else -1 for m in mask], np.int32),
                  reward=reward, prompt_len=prompt_len, group_index=index,
                  metadata={"temperature": 1.0, **metadata})


def build_run(run: Path) -> int:
    """A finished run folder of a calculator agent (two policies, versions 0 and 1); returns
    how many samples it holds."""
    from astralight.trainer.tinymodel import build_chat_tokenizer

    tok = build_chat_tokenizer()
    tok.save_pretrained(str(run / "models" / "init"))
    flow = Dataflow(DataflowConfig(state_dir=str(run / "dataflow"), model_ids=POLICIES,
                                   group_size=3))
    n = 0
    try:
        iid = flow.register(POLICIES, 8, None, {})["instance_id"]
        for version in (0, 1):
            if version:
                for m in POLICIES:
                    publish(flow, version, m)
            for task, (question, expr, answer) in zip(flow.lease(iid, 3), QUESTIONS):
                prompt = (f"<|im_start|>system\ntools: calculator<|im_end|>\n<|im_start|>user\n"
                          f"{question}<|im_end|>\n<|im_start|>assistant\n")
                samples = []
                for m in POLICIES:
                    for g in range(3):
                        index = len(samples)
                        good, bad_args = (g + version) % 3 != 0, g == 2
                        args = '{"expression": 7}' if bad_args else f'{{"expression": "{expr}"}}'
                        result = ("error: expression must be a string" if bad_args else answer)
                        said = answer if good else EVIL + " 42"
                        turns = [("model", f'<tool_call>{{"name": "calculator", "arguments": '
                                           f'{args}}}</tool_call><|im_end|>'),
                                 ("env", f"\n<|im_start|>user\n<tool_response>\n{result}\n"
                                         f"</tool_response><|im_end|>\n<|im_start|>assistant\n"),
                                 ("model", f"The answer is {said}.<|im_end|>")]
                        samples.append(_sample(
                            tok, task.task_id, index, m, prompt, turns, float(good), version,
                            {"turns": 2, "end": "answer", "tool_calls": 1, "answer": said,
                             "tool_errors": {"malformed": 0, "bad_arguments": int(bad_args)}}))
                flow.push(iid, task.task_id, samples)
                n += len(samples)
    finally:
        flow.close()
    return n


def test_viewer_page_renders_and_its_script_runs_in_headless_chromium(tmp_path):
    browser = chromium()
    run = tmp_path / "run"
    total = build_run(run)
    page = write_viewer(run)
    url = page.resolve().as_uri()

    shot = tmp_path / "viewer.png"
    browse(browser, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,900",
           url + "#colour=lp&error=bad_arguments")
    data = shot.read_bytes()
    assert data[:8] == PNG_MAGIC, "not a PNG"
    assert len(data) > 20_000, f"a near-empty screenshot ({len(data)} bytes)"
    try:
        from PIL import Image
    except ImportError:  # the byte checks above stand alone
        Image = None
    if Image is not None:
        with Image.open(shot) as img:
            assert img.size == (1280, 900)
            colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert len(colours) > 50, f"only {len(colours)} colours: a blank page?"
        assert max(c for c, _ in colours) < 0.9 * 1280 * 900, "one colour covers the page"
    if os.environ.get("ASTRALIGHT_VIEWER_SCREENSHOT"):
        shutil.copy(shot, os.environ["ASTRALIGHT_VIEWER_SCREENSHOT"])

    # the script ran (the CSP let it), counted the samples, and model markup never ran
    dom = browse(browser, tmp_path / "profile", "--dump-dom", "--virtual-time-budget=3000", url)
    assert 'data-js="ready"' in dom
    assert f'data-shown="{total}">{total} of {total} samples shown<' in dom
    assert "PWNED" not in re.search(r"<title>(.*?)</title>", dom, re.S).group(1)
    assert "data-pwned" not in re.search(r"<body[^>]*>", dom).group(0)
    assert "&lt;script&gt;document.title='PWNED'&lt;/script&gt;" in dom  # shown as text

    # filters from the address: one policy, one tool error kind, a reward range
    dom = browse(browser, tmp_path / "profile", "--dump-dom", "--virtual-time-budget=3000",
                 url + "#policy=verifier&error=bad_arguments&rmin=0.5")
    kept = 3  # verifier, bad_arguments (g == 2): rewarded at v0 (all three) and v1 (none)
    assert f'data-shown="{kept}">{kept} of {total} samples shown<' in dom
    assert "mode-mask" in re.search(r"<body[^>]*>", dom).group(0)
