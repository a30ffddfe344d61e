"""What the host lets the sandbox use, and where its Python lives.

:func:`isolation_support` probes (once per process) whether ``unshare`` may create the sandbox's
namespaces; :func:`decide_isolation` turns an ``isolation`` argument into "namespaces or not";
:func:`interpreter` and :func:`hidden_ancestor` locate the interpreter the sandbox runs and the
directory above it that the sandbox user cannot traverse (covered and bound back inside the mount
namespace, see :mod:`astralight.rewards.sandbox`).
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys

from astralight.rewards.sandbox_result import SandboxError

__all__ = ["NS_FLAGS", "isolation_support", "decide_isolation", "interpreter",
           "hidden_ancestor"]

NS_FLAGS = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
            "--mount-proc"]


@functools.lru_cache(maxsize=1)
def isolation_support() -> dict:
    """What this host lets the sandbox use: ``{"namespaces": bool, "root": bool, "reason": str}``.

    Probed once per process by running ``unshare`` with the sandbox's flags.
    """
    root = os.geteuid() == 0
    exe = shutil.which("unshare")
    if exe is None:
        return {"namespaces": False, "root": root, "reason": "no unshare command on PATH"}
    try:
        proc = subprocess.run([exe, *NS_FLAGS, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"namespaces": False, "root": root, "reason": f"unshare failed: {e}"}
    if proc.returncode != 0:
        return {"namespaces": False, "root": root,
                "reason": "unshare refused: " + proc.stderr.decode(errors="replace").strip()}
    return {"namespaces": True, "root": root, "reason": "", "unshare": exe}


def interpreter() -> tuple[str, str]:
    """(real path of the Python binary, the installation prefix that holds it)."""
    exe = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not exe.startswith(prefix + os.sep):
        prefix = os.path.dirname(os.path.dirname(exe))
    return exe, prefix


def hidden_ancestor(path: str) -> str | None:
    """Topmost ancestor of ``path`` (or itself) that others cannot traverse, else None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        p = "/" + "/".join(parts[:i])
        try:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return p
        except OSError:
            return p
    return None


def decide_isolation(isolation: str) -> bool:
    """Whether a run with this ``isolation`` argument uses namespaces (SandboxError when
    ``namespaces`` is required and the host refuses them)."""
    if isolation not in ("auto", "namespaces", "basic"):
        raise ValueError(f"isolation: expected 'auto', 'namespaces' or 'basic', got {isolation!r}")
    if isolation == "basic":
        return False
    support = isolation_support()
    if support["namespaces"]:
        return True
    if isolation == "namespaces":
        raise SandboxError(f"isolation='namespaces' but this host refuses them: "
                           f"{support['reason']}; use isolation='auto' or 'basic'")
    return False
