"""Component processes started ahead of time: their slow imports done while the launcher checks.

A RaaS spends most of its start-up importing vLLM and torch (15-20 s on a 2-core CPU machine,
more than the engine build), and a trainer importing Lightning and transformers; the launcher
meanwhile checks the recipe (importing Lightning too) and prepares the initial model. Both are
independent, so ``astralight run`` starts one *prewarmed* process per RaaS and trainer before it
checks anything. A prewarmed process only imports modules -- it reads no config, opens no port,
builds no engine and writes nothing of the run -- then waits on its stdin. When the launcher
starts the component it sends one JSON line (the component's command line, environment and log
file) and the process becomes that component, exactly as if it had been started with that
command (``python -m MODULE ...`` or ``python -c CODE``, run as ``__main__``). One not needed
(the check failed, or no component fits it) is killed; end of input (the launcher died) ends it
too.

The prewarmed process is started with the component's CPU pinning, parent-death signal and
environment, less its tokens (``ASTRALIGHT_*TOKEN*``, sent at hand-off only). A component whose
environment or pinning turns out different from the prewarmed one's (say a placeholder in an
``env`` value), or whose prewarmed process died, is started fresh, as is every restart.
``ASTRALIGHT_PREWARM=0`` turns prewarming off.

Launcher side: :class:`PrewarmPool`; the process side: :func:`main`
(``python -m astralight.launch.prewarm``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

#: the environment variable that turns prewarming off (``0``, ``false``, ``no``, ``off``)
SWITCH_VAR = "ASTRALIGHT_PREWARM"


def _is_token_var(name: str) -> bool:
    return name.startswith("ASTRALIGHT_") and "TOKEN" in name


def without_tokens(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less the dataflow tokens, which a prewarmed process gets only at hand-off."""
    return {k: v for k, v in env.items() if not _is_token_var(k)}


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``ASTRALIGHT_PREWARM`` leaves prewarming on (the default)."""
    value = (os.environ if env is None else env).get(SWITCH_VAR, "1")
    return value.strip().lower() not in ("0", "false", "no", "off")


class Prewarmed:
    """One prewarmed process: its Popen, the environment and pinning it was started with, and
    the file its output goes to until the hand-off."""

    def __init__(self, kind: str, proc: subprocess.Popen, env: dict[str, str],
                 cpus: list[int] | None, death_signal: int, output: Path):
        self.kind, self.proc, self.env, self.cpus = kind, proc, env, cpus
        self.death_signal, self.output = death_signal, output

    def misfit(self, env: Mapping[str, str], cpus: Sequence[int] | None,
               death_signal: int) -> str | None:
        """Why a component with this environment, pinning and stop signal cannot be this
        process (None: it can): it must have the same of each, tokens aside, and the process
        must still be waiting."""
        if self.proc.poll() is not None:
            return f"the prewarmed process exited ({self.proc.returncode})"
        env = without_tokens(env)
        if env != self.env:
            keys = sorted(k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k))
            return f"the environment differs in {', '.join(keys)}"
        if list(cpus or []) != list(self.cpus or []):
            return f"the CPU pinning differs ({cpus} against {self.cpus})"
        if death_signal != self.death_signal:
            return "the stop signal differs"
        return None

    def hand_off(self, argv: Sequence[str], env: Mapping[str, str],
                 log_path: Path) -> subprocess.Popen | None:
        """Make the process the component ``argv`` (``[python, -m, MODULE, ...]`` or
        ``[python, -c, CODE, ...]``) with environment ``env``, its output appended to
        ``log_path``; the Popen, or None (the process is then stopped) when it cannot be."""
        argv = list(argv)
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] not in ("-m", "-c"):
            self.close()
            return None
        order = {"argv": argv[1:], "env": dict(env), "log": str(log_path)}
        try:
            self.proc.stdin.write((json.dumps(order) + "\n").encode())
            self.proc.stdin.close()
        except (OSError, ValueError):  # it died meanwhile: start the component fresh
            self.close()
            return None
        return self.proc

    def close(self) -> None:
        """Stop a process that was not handed off, and remove its output file. It is killed at
        once: it holds nothing but imported modules, and a refused recipe should not wait for
        vLLM's import to finish."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.output.unlink(missing_ok=True)


class PrewarmPool:
    """The launcher's prewarmed processes, taken by components of their kind in start order."""

    def __init__(self) -> None:
        self.waiting: list[Prewarmed] = []
        #: why the last :meth:`take` found none (one reason per process of that kind)
        self.misfits: list[str] = []

    def start(self, kind: str, imports: Sequence[str], env: Mapping[str, Any],
              cpus: Sequence[int] | None, death_signal: int, run_dir: Path) -> Prewarmed:
        """Start one prewarmed process for a component of ``kind`` importing ``imports``. The
        run folder is on its command line, so that :func:`astralight.launch.running_components`
        knows it as this run's."""
        from astralight.launch.proc import spawn

        env = without_tokens({k: str(v) for k, v in env.items()})
        fd, name = tempfile.mkstemp(prefix=f"astralight-prewarm-{kind}-", suffix=".log")
        output = Path(name)
        argv = [sys.executable, "-m", "astralight.launch.prewarm", "--kind", kind, "--run-dir",
                str(run_dir), "--output", str(output)]
        for module in imports:
            argv += ["--import", module]
        try:
            proc = spawn(argv, cpus=list(cpus) if cpus else None, stdin=subprocess.PIPE,
                         stdout=fd, stderr=subprocess.STDOUT, env=env, death_signal=death_signal)
        finally:
            os.close(fd)
        warm = Prewarmed(kind, proc, env, list(cpus) if cpus else None, death_signal, output)
        self.waiting.append(warm)
        return warm

    def take(self, kind: str, env: Mapping[str, str], cpus: Sequence[int] | None,
             death_signal: int) -> Prewarmed | None:
        """The first waiting process of ``kind`` that fits a component with this environment,
        pinning and stop signal, removed from the pool; None when none does (then
        :attr:`misfits` says why each of that kind did not)."""
        self.misfits = []
        for warm in self.waiting:
            if warm.kind != kind:
                continue
            why = warm.misfit(env, cpus, death_signal)
            if why is None:
                self.waiting.remove(warm)
                return warm
            self.misfits.append(why)
        return None

    def close(self) -> None:
        """Stop every process not taken."""
        while self.waiting:
            self.waiting.pop().close()


# ------------------------------------------------------------------------- the process side


def _become(order: dict, output: Path) -> None:
    """Take over the component's log (what the imports printed first), environment and
    standard streams."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, output.read_bytes())
    except OSError:
        pass
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    output.unlink(missing_ok=True)
    os.environ.clear()
    os.environ.update(order["env"])


def main(argv: list[str] | None = None) -> int | None:
    """Import, wait for the hand-off, then run the component as ``__main__``."""
    parser = argparse.ArgumentParser(prog="python -m astralight.launch.prewarm")
    parser.add_argument("--kind", required=True)
    parser.add_argument("--run-dir", required=True, help="the run it is for (identifies it)")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--import", dest="imports", action="append", default=[])
    args = parser.parse_args(argv)
    for module in args.imports:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the component's own start reports it properly
            pass
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # not needed
    order = json.loads(line)
    _become(order, args.output)
    flag, target, *rest = order["argv"]
    if flag == "-m":
        sys.argv = [target, *rest]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *rest]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    return 0


if __name__ == "__main__":
    sys.exit(main())
