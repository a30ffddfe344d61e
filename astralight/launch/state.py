"""The launcher's run-folder state: ``launch_state.json`` (restarts, trainer time and resumptions,
added up over launches, and one record per launch that ended with a summary), atomic writes,
and the trainers' checkpoints a restart or ``--resume`` continues from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from astralight.atomic_files import atomic_write_bytes

if TYPE_CHECKING:
    from astralight.launch.components import Component
    from astralight.launch.supervise import Supervisor


def write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` so that a reader (or a crash) sees the old file or the new one,
    never half of one (:func:`astralight.atomic_files.atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode())
    return path


def checkpoint_dirs(trainer_cfg: dict, run_dir: Path) -> list[Path]:
    """Where a trainer config's ``ModelCheckpoint`` callbacks write (their ``dirpath``); without
    one, the Lightning default under ``trainer.default_root_dir`` (searched recursively)."""
    trainer = (trainer_cfg or {}).get("trainer") or {}
    dirs = []
    for cb in trainer.get("callbacks") or []:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("ModelCheckpoint"):
            dirpath = (cb.get("init_args") or {}).get("dirpath")
            if dirpath:
                dirs.append(Path(dirpath))
    if not dirs:
        dirs.append(Path(trainer.get("default_root_dir") or run_dir))
    return dirs


def last_checkpoint(trainer_cfg: dict, run_dir: Path) -> Path | None:
    """The newest ``last*.ckpt`` a trainer config's checkpoint callbacks wrote, or None."""
    found: list[Path] = []
    for d in checkpoint_dirs(trainer_cfg, run_dir):
        if not d.is_dir():
            continue
        explicit = any(str(cb.get("class_path", "")).endswith("ModelCheckpoint")
                       for cb in ((trainer_cfg or {}).get("trainer") or {}).get("callbacks") or []
                       if isinstance(cb, dict))
        found += list(d.glob("last*.ckpt") if explicit else d.rglob("last*.ckpt"))
    found = [p for p in found if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


#: the launcher's own state in the run folder, kept across --resume
LAUNCH_STATE = "launch_state.json"


def _load_launch_state(run_dir: Path) -> dict:
    try:
        state = json.loads((run_dir / LAUNCH_STATE).read_text())
    except (OSError, ValueError):
        state = {}
    state.setdefault("restarts", {})
    state.setdefault("restart_events", [])
    state.setdefault("trainer_seconds", 0.0)
    state.setdefault("resumes", 0)
    state.setdefault("launches", [])
    return state


def _save_launch_state(run_dir: Path, prior: dict, sup: Supervisor, comps: list[Component],
                       this_launch: dict | None = None) -> dict:
    """The run's restarts and trainer time so far, this launch's added to the earlier ones', and
    ``launches``: the earlier launches' records, then ``this_launch``'s (once it is known)."""
    restarts = dict(prior["restarts"])
    for name, n in sup.restarts.items():
        restarts[name] = restarts.get(name, 0) + n
    state = {"restarts": restarts,
             "restart_events": prior["restart_events"] + [e.as_dict() for e in sup.events],
             "trainer_seconds": round(prior["trainer_seconds"] + sum(
                 c.seconds_alive() for c in comps if c.kind == "trainer"), 1),
             "resumes": prior["resumes"],
             "launches": prior["launches"] + ([this_launch] if this_launch else [])}
    write_atomic(run_dir / LAUNCH_STATE, json.dumps(state, indent=2))
    return state


def _trainer_resume_args(comp: Component, run_dir: Path) -> tuple[list[str], str]:
    """``--ckpt_path PATH`` of the trainer's newest last checkpoint (or nothing), and a note."""
    ckpt = last_checkpoint(comp.config or {}, run_dir)
    if ckpt is None:
        return [], "from scratch (no last checkpoint yet)"
    return ["--ckpt_path", str(ckpt)], f"from {ckpt}"
