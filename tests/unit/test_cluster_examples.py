"""The cluster launch examples (examples/cluster/) start real astralight commands with real flags.

- every Kubernetes manifest parses (``yaml.safe_load_all``) into objects with apiVersion, kind
  and a name, and every container that runs astralight does so with an existing sub-command;
- every shell script passes ``bash -n``;
- every ``astralight <sub-command>`` found in a script or a manifest uses only flags that its
  ``--help`` lists (``fit``'s ``--model.*`` / ``--data.*`` must be init arguments of the classes
  the trainer configs name), and every config file it names exists in this repository;
- the autoscaler's command templates name the instance they act on.

No cluster is needed: the commands are read, not run (only ``--help``).
"""

from __future__ import annotations

import inspect
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "cluster"
MANIFESTS = sorted((CLUSTER / "k8s").glob("*.yaml"))
SCRIPTS = sorted(p for p in (CLUSTER / "slurm").iterdir() if p.suffix in (".sh", ".sbatch"))
#: where the manifests expect this repository inside the image
IMAGE_REPO = "/opt/astralight/"
SUBCOMMANDS = {"run", "dataflow", "raas", "fit", "autoscale", "report", "prepare-toy"}
SHELL_OPS = {"&", "&&", "||", ";", "|", ">", ">>", "2>&1", "<"}
#: flags whose value is a config file of this repository
CONFIG_FLAGS = {"--config", "--raas-config"}


def test_examples_exist():
    assert MANIFESTS and SCRIPTS
    kinds = {d["kind"] for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d}
    assert {"Deployment", "Service", "Job", "Secret", "PersistentVolumeClaim"} <= kinds
    assert (CLUSTER / "README.md").is_file()


# ------------------------------------------------------------------------------ extraction


def _shell_lines(text: str) -> list[str]:
    """Logical lines of a shell script: continuations joined, comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    return out


def _resolve(token: str) -> str:
    """``${VAR:-default}`` -> default (recursively); other variables stay as they are."""
    prev = None
    while prev != token:
        prev = token
        token = re.sub(r"\$\{[A-Za-z_]\w*:-([^${}]*)\}", r"\1", token)
    return token


def _commands_in_tokens(tokens: list[str]) -> list[list[str]]:
    """Every ``astralight ...`` command in a token list, up to a shell operator."""
    found = []
    for i, tok in enumerate(tokens):
        if tok == "astralight" or tok.endswith("/astralight"):
            cmd = []
            for t in tokens[i + 1:]:
                if t in SHELL_OPS or t.startswith(">") or t.startswith("2>"):
                    break
                cmd.append(t)
            found.append(cmd)
    return found


def _defaults(lines: list[str]) -> dict[str, str]:
    """``VAR=${VAR:-default}`` assignments of a script: the values a plain run uses."""
    out = {}
    for line in lines:
        m = re.match(r"^([A-Za-z_]\w*)=\$\{\1:-([^${}]*)\}\s*(#.*)?$", line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _script_commands(path: Path) -> list[list[str]]:
    cmds = []
    lines = _shell_lines(path.read_text())
    defaults = _defaults(lines)

    def expand(tok: str) -> str:
        tok = _resolve(tok)
        return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: defaults.get(m.group(1), m.group(0)), tok)

    for line in lines:
        if "astralight " not in line:
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote would also fail bash -n
            pytest.fail(f"{path.name}: cannot tokenize {line!r}")
        cmds += [[expand(t) for t in c] for c in _commands_in_tokens(tokens)]
    return cmds


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec") or {}
    template = spec.get("template") or spec.get("jobTemplate", {}).get("spec", {}).get("template")
    pod = (template or {}).get("spec") or {}
    return list(pod.get("containers") or []) + list(pod.get("initContainers") or [])


def _manifest_commands(path: Path) -> list[list[str]]:
    cmds = []
    for doc in yaml.safe_load_all(path.read_text()):
        for c in _containers(doc or {}):
            argv = [str(x) for x in (c.get("command") or []) + (c.get("args") or [])]
            if argv[:2] in (["sh", "-c"], ["bash", "-c"]) and len(argv) > 2:
                argv = shlex.split(argv[2])
            cmds += _commands_in_tokens(argv)
    return cmds


ALL_COMMANDS = ([(p.name, c) for p in SCRIPTS for c in _script_commands(p)]
                + [(p.name, c) for p in MANIFESTS for c in _manifest_commands(p)])


# ------------------------------------------------------------------------------ help texts


@lru_cache(maxsize=None)
def _help(sub: tuple[str, ...]) -> str:
    out = subprocess.run([sys.executable, "-m", "astralight.cli", *sub, "--help"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, f"astralight {' '.join(sub)} --help failed:\n{out.stderr[-2000:]}"
    return out.stdout


def _init_args(class_path: str) -> set[str]:
    module, _, name = class_path.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    names = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= set(inspect.signature(init).parameters) - {"self", "args", "kwargs"}
    return names


def _repo_path(value: str) -> Path | None:
    """The repository file a config value names, or None when it is not a literal path."""
    if "$" in value or "{" in value:
        return None
    if value.startswith(IMAGE_REPO):
        value = value[len(IMAGE_REPO):]
    return ROOT / value


def _check(where: str, cmd: list[str]) -> None:
    assert cmd and cmd[0] in SUBCOMMANDS, f"{where}: astralight {cmd[:1]} is not a sub-command"
    sub = tuple(cmd[:2]) if cmd[0] in ("dataflow", "raas") else (cmd[0],)
    if cmd[0] in ("dataflow", "raas"):
        assert cmd[1:2] == ["serve"], f"{where}: astralight {cmd[0]} needs 'serve'"
    helptext = _help(sub)
    args = cmd[len(sub):]
    config = None
    for i, tok in enumerate(args):
        if not tok.startswith("--"):
            continue
        flag = tok.split("=", 1)[0]
        value = tok.split("=", 1)[1] if "=" in tok else (args[i + 1] if i + 1 < len(args) else "")
        if flag in CONFIG_FLAGS:
            path = _repo_path(value)
            if path is not None:
                assert path.is_file(), f"{where}: {flag} {value}: no such file in the repository"
                config = path
        if sub == ("fit",) and re.match(r"--(model|data)\.", flag):
            group, attr = flag[2:].split(".", 1)
            assert re.search(rf"--{group}\b", helptext), f"{where}: {flag}: no --{group} group"
            if config is not None:
                spec = yaml.safe_load(config.read_text())[group]
                assert attr in _init_args(spec["class_path"]), (
                    f"{where}: {flag}: {attr!r} is not an argument of {spec['class_path']}")
            continue
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}([\s,=\]]|$)", helptext, re.M), (
            f"{where}: astralight {' '.join(sub)} has no flag {flag}")


@pytest.mark.parametrize("where,cmd", ALL_COMMANDS,
                         ids=[f"{w}:{' '.join(c[:2])}:{i}" for i, (w, c) in enumerate(ALL_COMMANDS)])
def test_astralight_command_and_flags_exist(where, cmd):
    _check(where, cmd)


def test_every_component_is_started():
    started = {(c[0], c[1] if len(c) > 1 and c[0] in ("dataflow", "raas") else "")
               for _, c in ALL_COMMANDS}
    for wanted in [("dataflow", "serve"), ("raas", "serve"), ("fit", ""), ("autoscale", "")]:
        assert wanted in started, f"no example starts astralight {' '.join(wanted)}"
    for kind, cmds in (("slurm", [c for w, c in ALL_COMMANDS if w.endswith(".sbatch")]),
                       ("k8s", [c for w, c in ALL_COMMANDS if w.endswith(".yaml")])):
        assert {c[0] for c in cmds} >= {"dataflow", "raas", "fit", "autoscale"}, kind


def test_a_wrong_flag_is_caught():
    """The check is real: a misspelt flag and a missing config file both fail."""
    with pytest.raises(AssertionError, match="no flag --max-instances"):
        _check("t", ["autoscale", "--max-instances", "3"])
    with pytest.raises(AssertionError, match="no such file"):
        _check("t", ["dataflow", "serve", "--config", "configs/nope.yaml"])
    with pytest.raises(AssertionError, match="not an argument"):
        _check("t", ["fit", "--config", "configs/toy/trainer.yaml", "--data.dataflow_uri", "x"])


def test_autoscaler_templates_name_the_instance():
    templates = []
    for _, cmd in ALL_COMMANDS:
        if cmd[0] == "autoscale":
            templates += [cmd[i + 1] for i, t in enumerate(cmd[:-1])
                          if t in ("--launch-cmd", "--retire-cmd", "--alive-cmd")]
    assert len(templates) >= 6  # slurm and k8s: launch, retire, alive each
    for t in templates:
        assert "{instance}" in t, t


# ------------------------------------------------------------------------------ files


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path.name}: no documents"
    for d in docs:
        assert d.get("apiVersion") and d.get("kind"), f"{path.name}: apiVersion/kind missing"
        assert d.get("metadata", {}).get("name"), f"{path.name}: {d['kind']} has no name"
        for c in _containers(d):
            if "astralight" in (c.get("command") or []):
                env = {e["name"] for e in c.get("env") or []}
                assert "ASTRALIGHT_TOKEN" in env, f"{path.name}: {c['name']} gets no token"


def test_gpu_requests_and_storage():
    docs = {(d["kind"], d["metadata"]["name"]): d
            for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d}
    raas = docs[("Deployment", "astralight-raas")]
    assert raas["spec"]["replicas"] >= 1
    limits = _containers(raas)[0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    dataflow = docs[("Deployment", "astralight-dataflow")]
    claims = {v["persistentVolumeClaim"]["claimName"]
              for v in dataflow["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert "astralight-dataflow-state" in claims
    assert ("PersistentVolumeClaim", "astralight-dataflow-state") in docs
    assert ("Service", "astralight-dataflow") in docs


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_syntax(path):
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert path.read_text().startswith("#!/bin/bash")
