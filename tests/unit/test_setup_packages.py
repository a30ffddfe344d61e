"""setup.cfg lists every package under astralight/: the list is explicit (callbacks/, datamodules/
and raas/ are mapped into the namespace), so a new subpackage left out of it would be missing
from a wheel install while an editable install still finds it."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_astralight_subpackage_is_in_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "astralight").rglob("__init__.py")}
    assert found, "no package found under astralight/"
    missing = sorted(found - listed)
    assert not missing, f"setup.cfg [options] packages lacks {missing}; add them"
