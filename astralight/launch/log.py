"""``RUN/launch.log``: everything the launcher itself prints, kept in the run folder.

Why: the components have their logs under ``RUN/logs/``, but the launcher's own lines -- progress
with rate and ETA, restarts and recoveries, the stop and its reason, the final summary line, a
failure -- would otherwise exist only on the terminal, lost when it closes or under a scheduler.

:class:`LaunchLog` copies the launcher process's ``sys.stdout`` and ``sys.stderr`` into the file
from :meth:`LaunchLog.open` (once the run folder is known) until :meth:`LaunchLog.close`, each line
prefixed there with the wall-clock time (the terminal output is unchanged), appending across
``--resume``. :meth:`LaunchLog.note` writes a line to the file only (a ``--quiet`` run's progress,
the failure that ``astralight run`` then reports on stderr itself).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any


class _Tee:
    """A text stream writing to ``stream`` and, time-stamped per line, to the log file."""

    def __init__(self, stream: IO[str], owner: "LaunchLog"):
        self._stream = stream
        self._owner = owner

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        self._owner._write(text)
        return n

    def flush(self) -> None:
        self._stream.flush()
        self._owner._flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding...: the terminal's
        return getattr(self._stream, name)


class LaunchLog:
    """See the module docstring. Usable as a context manager (closing on exit)."""

    def __init__(self):
        self.path: Path | None = None
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self._line_start = True
        self._saved: tuple[Any, Any] | None = None

    def open(self, path: Path) -> "LaunchLog":
        """Start copying stdout and stderr into ``path`` (appended)."""
        if self._file is not None:
            return self
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self), _Tee(sys.stderr, self)
        return self

    def note(self, line: str) -> None:
        """``line`` into the log file only (nothing when it is not open)."""
        self._write(line.rstrip("\n") + "\n")

    def _write(self, text: str) -> None:
        with self._lock:
            if self._file is None or not text:
                return
            stamp = time.strftime("%Y-%m-%d %H:%M:%S ")
            out = []
            for piece in text.splitlines(keepends=True):
                if self._line_start:
                    out.append(stamp)
                out.append(piece)
                self._line_start = piece.endswith("\n")
            self._file.write("".join(out))

    def _flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        """Stop copying; stdout and stderr are what they were before :meth:`open`."""
        if self._saved is not None:
            out, err = self._saved
            if isinstance(sys.stdout, _Tee) and sys.stdout._owner is self:
                sys.stdout = out
            if isinstance(sys.stderr, _Tee) and sys.stderr._owner is self:
                sys.stderr = err
            self._saved = None
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> "LaunchLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_CURRENT: list[LaunchLog] = []


def kept_in_launch_log(func):
    """Decorator of ``astralight run``'s entry point: ``func`` runs with a :class:`LaunchLog`
    (:func:`current_launch_log`, opened by ``func`` once it knows the run folder), closed when it
    returns or raises -- an exception noted in the log first, so a failure is kept too."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        log = LaunchLog()
        _CURRENT.append(log)
        try:
            return func(*args, **kwargs)
        except KeyboardInterrupt:
            log.note("[launch] interrupted")
            raise
        except BaseException as exc:
            log.note(f"[launch] failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            _CURRENT.remove(log)
            log.close()

    return wrapper


def current_launch_log() -> LaunchLog:
    """The innermost :func:`kept_in_launch_log` call's log (outside one: a log never opened,
    whose :meth:`LaunchLog.note` does nothing)."""
    return _CURRENT[-1] if _CURRENT else LaunchLog()


__all__ = ["LaunchLog", "kept_in_launch_log", "current_launch_log"]
