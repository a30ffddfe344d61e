"""``--check``'s error messages: a jsonargparse / LightningCLI error turned into one line that
names the recipe key and the fix (:func:`explain`), and the Lightning ``Trainer``'s arguments read
without importing Lightning (:func:`trainer_arguments`, for "did you mean" on ``trainer:`` keys).
Used by :mod:`astralight.launch.check`."""

from __future__ import annotations

import difflib
import inspect
import re
from pathlib import Path
from typing import Any


#: the parts of a jsonargparse / LightningCLI error message that locate and explain it
_TOKENS = re.compile(
    r'Parser key "(?P<key>[^"]+)"'
    r"|Problem with given class_path '(?P<cls>[^']+)'"
    r"|Group '(?P<group>[^']+)' does not accept option '(?P<gopt>[^']+)'"
    r"|Option '(?P<opt>[^']+)' is not accepted"
    r"|has no attribute '(?P<attr>[^']+)'"
    r"|No module named '(?P<module>[^']+)'"
    r"|Expected a <class '(?P<expected>[^']+)'>\.? ?(?:Got value: (?P<got>.+?))?(?= - |$)"
    r"|Expected a typing\.Literal\[(?P<literal>[^\]]*)\]\.? ?(?:Got value: (?P<lgot>.+?))?(?= - |$)"
    r"|Not of type (?P<nottype>\w+): (?P<why>.+?)(?= - |$)")


def _class_arguments(class_path: str) -> list[str]:
    """The constructor arguments of an (already importable) class, for "did you mean": a
    constructor that takes ``**kwargs`` passes them on to its bases (``M2POPolicy`` to
    ``RLPolicy``), whose arguments count too, as jsonargparse resolves them."""
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception:
        return []
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            break
        names += [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                  and p.name != "self" and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _locate(config: Any, parts: list[str]) -> Any:
    node = config
    for part in parts:
        for key in part.split("."):
            if key.endswith("]") and "[" in key:
                key, index = key[:-1].split("[")
                node = node.get(key) if isinstance(node, dict) else None
                node = node[int(index)] if isinstance(node, list) and int(index) < len(node) else None
            else:
                node = node.get(key) if isinstance(node, dict) else None
    return node


def explain(message: str, where: str, config: dict | None = None,
            options: list[str] | None = None) -> str:
    """A jsonargparse (or LightningCLI) error ``message`` as ``KEY: reason``, the key a recipe
    key (``where`` + the path inside the component's config: ``recipe.trainers[0].model.
    init_args.lrr``), with the closest valid name where one is known (``options``: the parser's
    own keys; a class's constructor arguments for its ``init_args``). ``config`` (the component's
    config) turns a list position into an index (``trainer.callbacks[0]``)."""
    message = " ".join(message.split())
    named = re.match(r"^([A-Za-z_][\w.\[\]]*): (.*)$", message)
    if named and named.group(1) != "Parser":  # a message of astralight's own: it names the key
        return f"{where}.{named.group(1)}: {named.group(2)}"
    parts: list[str] = []
    cls = None
    reason = None
    candidates: list[str] = []
    for m in _TOKENS.finditer(message):
        if m["key"]:
            if cls is not None:  # a key inside a class's arguments
                parts.append("init_args")
                cls = None
            parts.append(m["key"])
        elif m["cls"]:
            cls = m["cls"]
            node = _locate(config, parts) if config is not None and parts else None
            if isinstance(node, list) and parts:
                index = next((i for i, e in enumerate(node)
                              if isinstance(e, dict) and e.get("class_path") == cls), None)
                if index is not None:
                    parts[-1] += f"[{index}]"
        elif m["gopt"]:
            parts += [m["group"], m["gopt"]]
            prefix = ".".join(parts[:-1]) + "."
            candidates = [o[len(prefix):] for o in options or [] if o.startswith(prefix)]
            if m["group"] == "trainer" and not candidates:
                candidates = trainer_arguments() or []
            reason = f"unknown key (no option {m['gopt']!r} in {m['group']!r})"
            break
        elif m["opt"]:
            if cls is not None:
                parts += ["init_args", m["opt"]]
                candidates = _class_arguments(cls)
                reason = f"unknown key ({cls} has no argument {m['opt']!r})"
            else:
                parts.append(m["opt"])
                prefix = ".".join(parts[:-1])
                candidates = [o[len(prefix) + 1:] if prefix else o for o in options or []
                              if not prefix or o.startswith(prefix + ".")]
                reason = "unknown key"
            break
        elif m["attr"] or m["module"]:
            parts.append("class_path")
            reason = f"cannot import {cls or m['attr'] or m['module']!r}; check the module path, " \
                     "and that its folder is in the recipe's `pythonpath`"
            break
        elif m["expected"]:
            if m["expected"] == "NoneType":
                continue
            reason = f"expected {m['expected']}" + (f", got {m['got']}" if m["got"] else "")
            break
        elif m["literal"] is not None:
            if cls is not None:
                parts.append("init_args")
            got = m["lgot"]
            if got is None and config is not None:
                got = _locate(config, parts)
            choices = re.findall(r"'([^']*)'", m["literal"])
            close = difflib.get_close_matches(str(got), choices, n=1) if got is not None else []
            return (f"{where}.{'.'.join(parts)}: "
                    + (f"got {got!r}; " if got is not None else "")
                    + f"expected one of {m['literal']}"
                    + (f"; did you mean {close[0]!r}?" if close else ""))
        elif m["nottype"]:
            reason = f"not {m['nottype']}: {m['why']}"
            break
    if reason is None:
        short = message if len(message) <= 300 else message[:300] + " ..."
        return f"{where}{'.' + '.'.join(parts) if parts else ''}: {short}"
    last = parts[-1].split(".")[-1] if parts else ""
    close = difflib.get_close_matches(last, [c.split(".")[-1] for c in candidates], n=1)
    hint = f"; did you mean {close[0]!r}?" if close and close[0] != last else ""
    return f"{where}.{'.'.join(parts)}: {reason}{hint}"


def trainer_arguments() -> list[str] | None:
    """The arguments of Lightning's ``Trainer``, read from its source without importing
    Lightning (the import costs seconds of CPU: torch, torchmetrics, transformers), or None when
    the source cannot be read. Lets a typo in a ``trainer:`` section fail at once; the
    LightningCLI parse after it remains the authority."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("lightning")
        source = Path(list(spec.submodule_search_locations)[0]) / "pytorch" / "trainer" / "trainer.py"
        tree = ast.parse(source.read_text())
    except (ImportError, AttributeError, IndexError, TypeError, OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Trainer":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    if item.args.kwarg is not None:
                        return None  # takes anything: nothing to check here
                    args = item.args.posonlyargs + item.args.args + item.args.kwonlyargs
                    return [a.arg for a in args if a.arg != "self"]
    return None
