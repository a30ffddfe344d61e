"""What one sandboxed run produced (:class:`SandboxResult`) and the one error the sandbox itself
raises (:class:`SandboxError`); shared by the runner and the public entry points of
:mod:`astralight.rewards.sandbox`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SandboxError", "SandboxResult"]


class SandboxError(RuntimeError):
    """The sandbox itself could not run a program (never raised for what the program does)."""


@dataclass
class SandboxResult:
    """How one program run ended.

    ``status``: ``ok`` (exit 0), ``error`` (non-zero exit, e.g. an exception), ``timeout`` (CPU or
    wall limit), ``memory`` (``MemoryError`` under the address-space limit), ``output_limit``
    (killed for writing more than ``max_output_bytes``), ``killed`` (another signal).
    ``returncode``: the exit code, ``-signal`` when a signal ended it, None when the sandbox killed
    it at the wall deadline or for output. ``cpu_s``: user + system CPU of the program and the
    children it waited for (None when it was killed before reporting). ``stdout``/``stderr`` keep
    the first ``output_cap`` bytes (decoded as UTF-8 with replacement); ``*_truncated`` says when
    more was written. ``pgid`` is the process group the run lived in (all of it is killed at the
    end). ``isolation`` names the layers applied. :func:`run_call` only: ``returned`` is the JSON
    text of the value the called function returned (None when the harness did not report one
    validly; ``harness_error`` says why).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    cpu_s: float | None
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    signal: int | None = None
    pgid: int = 0
    isolation: tuple[str, ...] = field(default_factory=tuple)
    returned: str | None = None
    harness_error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"
