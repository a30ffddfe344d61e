"""The example's ``prepare`` step: the agent's virtualenv (``verifiers==0.4.0``, which cannot be
installed beside vLLM) and the warm-started calculator policy of examples/openai_agent/.

The virtualenv is made once per machine under ``~/.cache/astralight/venvs/`` (about 3 minutes
and 600 MB here: pip, from the package registry) and reused by every run; a ``ready`` file marks
a finished install, so an interrupted one is redone. By hand, the same::

    python -m venv ~/.cache/astralight/venvs/verifiers-0.4.0
    ~/.cache/astralight/venvs/verifiers-0.4.0/bin/pip install verifiers==0.4.0
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

from astralight.tasks.tool_warmstart import build_tool_policy

#: where the example's recipe looks for the agent's interpreter (``python:``)
VENV = Path("~/.cache/astralight/venvs/verifiers-0.4.0").expanduser()
REQUIREMENTS = ["verifiers==0.4.0"]


def ensure_venv(path: Path = VENV, requirements: list[str] = REQUIREMENTS) -> Path:
    """The virtualenv at ``path`` with ``requirements`` installed (made if missing); its
    interpreter's path."""
    python = path / "bin" / "python"
    marker = path / "ready"
    if marker.exists() and marker.read_text() == " ".join(requirements):
        return python
    if path.exists():
        shutil.rmtree(path)  # an interrupted or older install
    t0 = time.time()
    print(f"[prepare] making the agent's virtualenv {path} ({' '.join(requirements)}) ...",
          flush=True)
    venv.create(path, with_pip=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(requirements)} into {path} failed (exit "
                           f"{proc.returncode}): {proc.stderr[-2000:]}")
    marker.write_text(" ".join(requirements))
    print(f"[prepare] virtualenv ready in {time.time() - t0:.0f}s", flush=True)
    return python


def build(out_dir: str | Path, venv_dir: str | None = None, **policy_kwargs) -> Path:
    """The recipe's ``prepare``: the agent's virtualenv, then the initial policy at ``out_dir``
    (:func:`astralight.tasks.tool_warmstart.build_tool_policy` with ``policy_kwargs``)."""
    ensure_venv(Path(venv_dir).expanduser() if venv_dir else VENV)
    return build_tool_policy(out_dir, **policy_kwargs)


build.vocab_size = build_tool_policy.vocab_size


if __name__ == "__main__":
    print(ensure_venv(Path(sys.argv[1]).expanduser() if len(sys.argv) > 1 else VENV))
