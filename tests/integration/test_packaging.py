"""The design card's layout survives packaging: callbacks/, datamodules/, raas/ and the toy recipe
import as astralight.* from a built wheel, not only from this checkout's editable install."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAPPED = ["astralight/callbacks/weight_publisher.py", "astralight/callbacks/dataflow_monitor.py",
          "astralight/datamodules/rollout.py", "astralight/raas/service.py",
          "astralight/raas/vllm_engine.py", "astralight/toy/recipe.yaml",
          "astralight/dataflow/service.py", "astralight/weights/delta.py"]


def test_wheel_maps_top_level_folders_into_the_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(REPO)], check=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("astralight-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in MAPPED:
        assert name in names, f"{name} missing from {wheel.name}"
    assert not any(n.startswith(("callbacks/", "datamodules/", "raas/", "tests/")) for n in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, timeout=300)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import astralight.callbacks as c, astralight.datamodules as d, astralight.raas.service as r;"
        "import astralight.launch as l;"
        "assert c.WeightPublisher and d.RolloutDataModule and r.main;"
        "paths = [c.__file__, d.__file__, r.__file__, str(l._default_recipe())];"
        "assert all(p.startswith(sys.argv[1]) for p in paths), paths;"
        "assert l._default_recipe().exists(); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_editable_install_resolves_to_this_checkout():
    import astralight.callbacks
    import astralight.raas
    import astralight.toy

    assert Path(astralight.callbacks.__file__).resolve().parent == REPO / "callbacks"
    assert Path(astralight.raas.__file__).resolve().parent == REPO / "raas"
    assert Path(astralight.toy.__file__).resolve().parent == REPO / "examples" / "toy"
