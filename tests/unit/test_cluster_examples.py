"""The cluster launch examples (examples/cluster/) start real astralight commands with real flags.

- every Kubernetes manifest parses (``yaml.safe_load_all``) into objects with apiVersion, kind
  and a name, and every container that runs astralight does so with an existing sub-command;
- every shell script passes ``bash -n``;
- every ``astralight <sub-command>`` found in a script or a manifest uses only flags that its
  ``--help`` lists (``fit``'s ``--model.*`` / ``--data.*`` must be init arguments of the classes
  the trainer configs name), and every config file it names exists in this repository;
- the autoscaler's command templates name the instance they act on;
- the Slurm scripts, run under bash with stand-ins for sbatch/srun/scancel/squeue and astralight:
  each trainer step gets its own MASTER_PORT and --cpus-per-task, resumes (``--ckpt_path last``,
  a run folder named by the run, not the job id), the token reaches processes but never a
  submitted job's environment, and a dataflow that does not come up fails the job.

No cluster is needed: the commands are read (only ``--help`` runs) or run against stand-ins.
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


# ------------------------------------------------------------------------------ the Slurm scripts, run
#
# The sbatch scripts run for real under bash with stand-ins for the cluster's commands on PATH
# (sbatch, srun, scancel, squeue, hostname, openssl) and for astralight itself; each stand-in
# records its argv and the environment variables that matter. srun applies ``--export=ALL,K=V``
# as Slurm does, so what the trainer sees is what the step exported.

FAKE = r'''#!PYTHON
import json, os, signal, subprocess, sys, time

name = os.path.basename(sys.argv[0])
argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"cmd": name, "argv": argv, "token": os.environ.get("ASTRALIGHT_TOKEN"),
                        "master_port": os.environ.get("MASTER_PORT")}) + "\n")


def serve_until_term():  # as astralight's services: SIGTERM or SIGINT stops them (recorded)
    def stop(signum, _frame):
        with open(os.environ["FAKE_LOG"], "a") as f:
            f.write(json.dumps({"cmd": f"{name}:exit", "argv": argv[:2],
                                "exit": signal.Signals(signum).name,
                                "token": None, "master_port": None}) + "\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        time.sleep(0.1)


if name == "hostname":
    print("node1.cluster")
elif name == "openssl":
    print("ab" * 32)
elif name == "sbatch":
    print("4242")
elif name == "squeue":
    # a job's state (-o %T): RUNNING with FAKE_SQUEUE_RUNNING; any other query: an empty queue
    print("RUNNING" if os.environ.get("FAKE_SQUEUE_RUNNING") and "%T" in argv else "")
elif name == "scancel" and argv == ["--signal=TERM", os.environ.get("SLURM_JOB_ID")]:
    # what Slurm does with it: SIGTERM to the job's steps (the trainers), not the batch script
    if os.path.exists(os.environ["FAKE_LOG"] + ".fit"):
        for pid in open(os.environ["FAKE_LOG"] + ".fit").read().split():
            os.kill(int(pid), signal.SIGTERM)
elif name == "srun":
    env, i = dict(os.environ), 0
    while argv[i].startswith("-"):
        if argv[i].startswith("--export="):
            for kv in argv[i].split("=", 1)[1].split(",")[1:]:
                k, v = kv.split("=", 1)
                env[k] = v
        i += 1
    os.execvpe(argv[i], argv[i:], env)
elif name == "astralight":
    if argv[:2] == ["dataflow", "serve"]:
        if os.environ.get("FAKE_DATAFLOW") == "crash":
            print("Traceback: boom", flush=True)
            sys.exit(1)
        if os.environ.get("FAKE_DATAFLOW") != "silent":
            print("dataflow serving on http://0.0.0.0:8400", flush=True)
        serve_until_term()
    if argv[0] == "autoscale":
        launch = argv[argv.index("--launch-cmd") + 1].replace("{instance}", "raas-x-0")
        subprocess.run(launch, shell=True, check=True, stdout=subprocess.DEVNULL)
        serve_until_term()
    if argv[0] == "fit" and os.environ.get("FAKE_FIT_UNTIL_TERM"):  # a trainer: runs until SIGTERM
        with open(os.environ["FAKE_LOG"] + ".fit", "a") as f:
            f.write(f"{os.getpid()}\n")
        serve_until_term()
    if argv[0] == "fit" and os.environ.get("FAKE_FIT_AFTER"):  # run until that command was seen
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(os.environ["FAKE_LOG"]) as f:
                if any(json.loads(line)["cmd"] == os.environ["FAKE_FIT_AFTER"] for line in f):
                    break
            time.sleep(0.05)
'''
FAKE_COMMANDS = ("hostname", "openssl", "sbatch", "srun", "scancel", "squeue", "astralight")
TOKEN_IN_FILE = "ab" * 32


@pytest.fixture
def slurm_sandbox(tmp_path):
    """``run(script, **env) -> (returncode, stderr, records)`` in a scratch submit directory."""
    import json
    import os
    import signal

    bin_dir, work, home = tmp_path / "bin", tmp_path / "work", tmp_path / "home"
    for d in (bin_dir, work, home):
        d.mkdir()
    for name in FAKE_COMMANDS:
        (bin_dir / name).write_text(FAKE.replace("PYTHON", sys.executable, 1))
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.jsonl"

    def run(script: str, **env: str):
        log.write_text("")
        full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home),
                "FAKE_LOG": str(log), "SLURM_SUBMIT_DIR": str(work), "SLURM_JOB_ID": "1234567",
                "SLURM_JOB_NAME": "astralight-main", "SLURM_CPUS_PER_TASK": "8",
                "ASTRALIGHT_TOKEN": "exported-in-the-login-shell", **env}
        proc = subprocess.Popen(["bash", str(CLUSTER / "slurm" / script)], env=full, cwd=work,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stand-ins a failing script left behind
            except ProcessLookupError:
                pass
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        return proc.returncode, out + err, calls

    def start(script: str, **env: str) -> subprocess.Popen:
        """Start ``script`` in the background (its own process group, as a job's processes)."""
        log.write_text("")
        full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home),
                "FAKE_LOG": str(log), "SLURM_SUBMIT_DIR": str(work), "SLURM_JOB_ID": "1234567",
                "SLURM_JOB_NAME": "astralight-main", "SLURM_CPUS_PER_TASK": "8", **env}
        proc = subprocess.Popen(["bash", str(CLUSTER / "slurm" / script)], env=full, cwd=work,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        started.append(proc)
        return proc

    def records():
        return [json.loads(line) for line in log.read_text().splitlines()]

    started: list[subprocess.Popen] = []
    run.work = work
    run.home = home
    run.start = start
    run.records = records
    run.fit_pids = lambda: (log.parent / (log.name + ".fit"))
    yield run
    for proc in started:  # stand-ins a failing script left behind
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _calls(calls, cmd, *first):
    return [c for c in calls if c["cmd"] == cmd and c["argv"][:len(first)] == list(first)]


def test_slurm_trainer_steps_get_their_own_port_cpus_and_resume(slurm_sandbox):
    rc, out, calls = slurm_sandbox(
        "astralight-main.sbatch", CONFIG_DIR="configs/qwen3_8b/solver_verifier_math",
        TRAINERS="trainer-solver.yaml:2 trainer-verifier.yaml:2")
    assert rc == 0, out
    fits = _calls(calls, "astralight", "fit")
    assert len(fits) == 2
    ports = [int(c["master_port"]) for c in fits]  # what Lightning's SLURMEnvironment reads
    assert len(set(ports)) == 2 and all(1024 < p < 32768 and p != 8400 for p in ports)
    for step in _calls(calls, "srun"):
        assert "--cpus-per-task=8" in step["argv"], step["argv"]
        assert any(a.startswith("--export=ALL,MASTER_PORT=") for a in step["argv"])
    for fit in fits:
        i = fit["argv"].index("--ckpt_path")
        assert fit["argv"][i + 1] == "last"
    # the run folder is named by the run, not the job id: a resubmission continues it
    run_dir = slurm_sandbox.work / "runs" / "slurm-astralight-main-solver_verifier_math"
    [dataflow] = _calls(calls, "astralight", "dataflow", "serve")
    state = dataflow["argv"][dataflow["argv"].index("--state_dir") + 1]
    assert state == "runs/slurm-astralight-main-solver_verifier_math/dataflow"
    assert run_dir.is_dir()
    # the token: from the run's file into the dataflow and the trainers, never into sbatch
    assert dataflow["token"] == TOKEN_IN_FILE and all(f["token"] == TOKEN_IN_FILE for f in fits)
    [pool] = _calls(calls, "sbatch")
    assert pool["token"] is None
    assert any(a.startswith("--export=ALL,") and "ASTRALIGHT_TOKEN_FILE=" in a
               and "ASTRALIGHT_TOKEN=" not in a for a in pool["argv"])
    # the pool is retired at the end: queued tasks cancelled, running ones drained by SIGTERM
    assert _calls(calls, "scancel", "--state=PENDING", "4242")
    assert _calls(calls, "scancel", "--signal=TERM", "--state=RUNNING", "4242")

    rc, out, again = slurm_sandbox(
        "astralight-main.sbatch", CONFIG_DIR="configs/qwen3_8b/solver_verifier_math",
        TRAINERS="trainer-solver.yaml:2 trainer-verifier.yaml:2", SLURM_JOB_ID="1234999")
    assert rc == 0, out
    [dataflow2] = _calls(again, "astralight", "dataflow", "serve")
    assert dataflow2["argv"] == dataflow["argv"] and dataflow2["token"] == TOKEN_IN_FILE
    # ... but not while another job still runs in that folder
    rc, out, busy = slurm_sandbox(
        "astralight-main.sbatch", CONFIG_DIR="configs/qwen3_8b/solver_verifier_math",
        SLURM_JOB_ID="1235000", FAKE_SQUEUE_RUNNING="1")
    assert rc != 0 and "still running" in out and not _calls(busy, "astralight")


def test_slurm_autoscaler_submits_raas_jobs_without_the_token(slurm_sandbox):
    rc, out, calls = slurm_sandbox("astralight-main.sbatch", AUTOSCALE_MIN="1", AUTOSCALE_MAX="3",
                                   FAKE_FIT_AFTER="sbatch")  # launched while the trainer runs
    assert rc == 0, out
    [scaler] = _calls(calls, "astralight", "autoscale")
    assert scaler["token"] == TOKEN_IN_FILE  # it talks to the dataflow
    [job] = _calls(calls, "sbatch")  # what its --launch-cmd submitted
    assert job["token"] is None and "--job-name=raas-x-0" in job["argv"]


@pytest.mark.parametrize("mode,message", [("silent", "did not report"),
                                          ("crash", "exited during start-up")])
def test_slurm_stops_when_the_dataflow_does_not_come_up(slurm_sandbox, mode, message):
    rc, out, calls = slurm_sandbox("astralight-main.sbatch", DATAFLOW_WAIT_S="2",
                                   FAKE_DATAFLOW=mode)
    assert rc != 0 and message in out, out
    assert not _calls(calls, "sbatch") and not _calls(calls, "srun")


def test_slurm_raas_job_reads_the_token_file(slurm_sandbox):
    token_file = slurm_sandbox.home / "token"
    token_file.write_text("cd" * 32 + "\n")
    rc, out, calls = slurm_sandbox("raas.sbatch", DATAFLOW_URL="http://node1:8400",
                                   ASTRALIGHT_TOKEN_FILE=str(token_file), SLURM_CPUS_PER_TASK="6")
    assert rc == 0, out
    [step] = _calls(calls, "srun")
    assert "--cpus-per-task=6" in step["argv"]
    [serve] = _calls(calls, "astralight", "raas", "serve")
    assert serve["token"] == "cd" * 32


def test_lightning_takes_master_port_from_the_environment(monkeypatch):
    """What the per-step MASTER_PORT relies on: SLURMEnvironment prefers MASTER_PORT to the port
    it derives from the job id (the same for every step of a job)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    monkeypatch.setenv("SLURM_JOB_ID", "1234567")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    derived = SLURMEnvironment().main_port
    monkeypatch.setenv("MASTER_PORT", "20571")
    assert derived != 20571 and SLURMEnvironment().main_port == 20571


# ------------------------------------------------------------------------------ issue 40: the Slurm fixes
# (tests/integration/test_slurm_cluster.py runs the same scripts on a live Slurm cluster)


def _sbatch_lines(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", path.read_text(), re.M))


@pytest.mark.parametrize("script", ["astralight-main.sbatch", "raas.sbatch"])
def test_slurm_output_needs_no_folder(script):
    """slurmd opens --output before the script runs: a folder the script would create (logs/)
    makes the first job of a fresh checkout fail with no output file at all."""
    output = _sbatch_lines(CLUSTER / "slurm" / script)["output"]
    assert "/" not in output and "%j" in output and "%a" not in output, output


def test_slurm_main_job_asks_for_a_warning_before_the_time_limit():
    """--signal=B:TERM@SECONDS: SIGTERM to the batch script alone before the time limit, so the
    script stops trainers, pool and dataflow in order while the job still runs."""
    assert re.match(r"B:TERM@\d+$", _sbatch_lines(CLUSTER / "slurm" / "astralight-main.sbatch")["signal"])


def test_slurm_raas_jobs_sized_and_the_bind_address_set_without_editing(slurm_sandbox):
    rc, out, calls = slurm_sandbox("astralight-main.sbatch", RAAS_GPUS="2", RAAS_CPUS="16",
                                   RAAS_SBATCH_ARGS="--partition=gpu --mem=64G",
                                   DATAFLOW_BIND="10.1.2.3", DATAFLOW_PORT="8500")
    assert rc == 0, out
    [pool] = _calls(calls, "sbatch")
    for opt in ("--gres=gpu:2", "--cpus-per-task=16", "--partition=gpu", "--mem=64G"):
        assert opt in pool["argv"], pool["argv"]
    assert any(a.startswith("--output=runs/slurm-") and a.endswith("/logs/%x-%j.out")
               for a in pool["argv"]), pool["argv"]
    [dataflow] = _calls(calls, "astralight", "dataflow", "serve")
    argv = dataflow["argv"]
    assert argv[argv.index("--host") + 1] == "10.1.2.3" and argv[argv.index("--port") + 1] == "8500"
    assert any(a.startswith("--export=ALL,DATAFLOW_URL=http://node1.cluster:8500,") for a in pool["argv"])
    rc, out, calls = slurm_sandbox("astralight-main.sbatch", RAAS_GPUS="0")
    assert rc == 0, out
    [pool] = _calls(calls, "sbatch")
    assert "--gres=none" in pool["argv"] and not any(a.startswith("--gres=gpu") for a in pool["argv"])


def test_slurm_autoscaler_templates_and_settings(slurm_sandbox):
    rc, out, calls = slurm_sandbox("astralight-main.sbatch", AUTOSCALE_MIN="1", AUTOSCALE_MAX="3",
                                   AUTOSCALE_COOLDOWN_S="45", AUTOSCALE_EVERY="5", RAAS_CPUS="4",
                                   FAKE_FIT_AFTER="sbatch")
    assert rc == 0, out
    [scaler] = _calls(calls, "astralight", "autoscale")
    flags = dict(zip(scaler["argv"][1::2], scaler["argv"][2::2]))
    assert flags["--cooldown-s"] == "45" and flags["--every"] == "5"
    assert flags["--shutdown-grace-s"] == "60"  # POOL_STOP_WAIT_S
    # a queued instance is cancelled plainly, a running one drained by SIGTERM
    assert flags["--retire-cmd"] == ("scancel --state=PENDING --name={instance}; "
                                     "scancel --signal=TERM --state=RUNNING --name={instance}")
    assert "COMPLETING" in flags["--alive-cmd"]
    [job] = _calls(calls, "sbatch")
    assert "--cpus-per-task=4" in job["argv"] and "--gres=gpu:1" in job["argv"]
    assert any(a.endswith("/logs/%x-%j.out") for a in job["argv"])  # %x: the instance id
    # the scaler's defaults: a cooldown of minutes, not ten
    rc, out, calls = slurm_sandbox("astralight-main.sbatch", AUTOSCALE_MAX="3", FAKE_FIT_AFTER="sbatch")
    [scaler] = _calls(calls, "astralight", "autoscale")
    assert scaler["argv"][scaler["argv"].index("--cooldown-s") + 1] == "120"


def _wait_for_fit(slurm_sandbox, n: int = 1) -> list[int]:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        path = slurm_sandbox.fit_pids()
        pids = [int(p) for p in path.read_text().split()] if path.exists() else []
        if len(pids) >= n:
            return pids
        time.sleep(0.05)
    pytest.fail("the trainer stand-in never started")


@pytest.mark.parametrize("how", ["scancel", "batch-only"])
def test_slurm_stop_order_trainers_then_pool_then_dataflow(slurm_sandbox, how):
    """SIGTERM mid-run, as Slurm sends it. ``scancel`` (or the time limit): to every process of
    the job at once -- the dataflow must outlive the trainer (its SIGTERM is blocked) and the
    trainer must get exactly one SIGTERM. ``batch-only`` (--signal=B:TERM@120, scancel --batch):
    the script alone -- it passes SIGTERM on to the job steps. Then: pool, then dataflow."""
    import os
    import signal

    env = {"FAKE_FIT_UNTIL_TERM": "1"}
    if how == "batch-only":
        env["FAKE_SQUEUE_RUNNING"] = "1"  # the job is still RUNNING: only the script was told
    proc = slurm_sandbox.start("astralight-main.sbatch", **env)
    _wait_for_fit(slurm_sandbox)
    if how == "scancel":
        os.killpg(proc.pid, signal.SIGTERM)  # Slurm: every process of the job
    else:
        proc.send_signal(signal.SIGTERM)     # the batch script only
    out, _ = proc.communicate(timeout=60)
    records = slurm_sandbox.records()
    assert proc.returncode == 143, out
    events = [(r["cmd"], r.get("exit"), r["argv"]) for r in records]
    fit_exit = [i for i, (c, e, a) in enumerate(events) if c == "astralight:exit" and a[:1] == ["fit"]]
    dataflow_exit = [i for i, (c, e, a) in enumerate(events)
                     if c == "astralight:exit" and a[:2] == ["dataflow", "serve"]]
    pool_stop = [i for i, (c, e, a) in enumerate(events) if c == "scancel" and "--state=PENDING" in a]
    assert len(fit_exit) == 1 and events[fit_exit[0]][1] == "SIGTERM", events
    assert len(dataflow_exit) == 1 and events[dataflow_exit[0]][1] == "SIGINT", events  # not Slurm's TERM
    assert fit_exit[0] < pool_stop[0] < dataflow_exit[0], events
    forwarded = _calls(records, "scancel", "--signal=TERM", "1234567")
    assert len(forwarded) == (1 if how == "batch-only" else 0), events  # never a second SIGTERM
    assert "trainers stopped; stopping the rollout pool" in out
    assert "rollout pool stopped; stopping the dataflow" in out
