"""The ``astralight`` command: one entry point, one sub-command per process kind.

    astralight run [RECIPE.yaml]                 start everything on this machine (the launcher)
    astralight --version                         the installed version
    astralight run --resume RUN_DIR              continue an interrupted run folder
    astralight dataflow serve --config X.yaml    the dataflow service
    astralight raas serve --dataflow URL --config X.yaml   a rollout service
    astralight fit --config X.yaml               a trainer (LightningCLI), one per policy
    astralight autoscale --dataflow URL --raas-config X.yaml --min N --max N   grow or shrink
                                                 the RaaS pool from the balance report
    astralight report RUN_DIR [--out DIR]         plots and a text summary of a run folder
    astralight export CKPT --out DIR [--model-path BASE] [--dtype bfloat16|float32|float16]
                      [--merge-lora] [--force]   a trainer checkpoint (file or FSDP2 folder) as a
                                                 Hugging Face model folder (or a LoRA adapter)
    astralight prepare-toy DIR                   build the toy recipe's warm-started tiny policy

Sub-commands import their component lazily, so ``astralight fit`` never imports vLLM and
``astralight raas`` never imports Lightning.
"""

from __future__ import annotations

import sys

#: what ``astralight --help`` prints: the docstring as plain text (no reST markup)
USAGE = __doc__.replace("``", "")


def flag_style(argv: list[str], dashes: bool) -> list[str]:
    """``argv`` with every ``--option`` name written in one style: dashes (``--run-dir``, the
    launcher's and the tools' own flags) or underscores (``--trainer.max_steps``: the config keys
    of ``fit`` and the services, which are Python names). Either spelling is accepted on every
    sub-command; the docs use dashes for astralight's own flags and underscores for config keys.
    Values (after ``=`` or as their own word) and anything after ``--`` are left alone."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + list(argv[i:])
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            name = name.replace("_", "-") if dashes else name.replace("-", "_")
            arg = f"--{name}{eq}{value}"
        out.append(arg)
    return out


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("astralight")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _fit(argv: list[str]) -> int:
    from astralight.trainer_cli import main as fit_main

    fit_main(argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"astralight {_version()}")
        return 0
    command, rest = argv[0], argv[1:]
    # argparse sub-commands spell flags with dashes, the jsonargparse ones (config keys) with
    # underscores: accept both (see flag_style)
    rest = flag_style(rest, dashes=command not in ("dataflow", "raas", "fit"))
    if command == "run":
        from astralight.launch import main as run_main

        return run_main(rest)
    if command in ("dataflow", "raas"):
        if not rest or rest[0] != "serve":
            usage = (f"usage: astralight {command} serve --config FILE.yaml [options]\n"
                     f"       astralight {command} serve --help   (every option)")
            asked = bool(rest) and rest[0] in ("-h", "--help")
            print(usage, file=sys.stdout if asked else sys.stderr)
            return 0 if asked else 2
        if command == "dataflow":
            from astralight.dataflow.service import main as serve
        else:
            from astralight.raas.service import main as serve
        return serve(rest[1:]) or 0
    if command == "fit":
        return _fit(rest)
    if command == "autoscale":
        from astralight.autoscale.service import main as autoscale_main

        return autoscale_main(rest)
    if command == "report":
        from astralight.report import main as report_main

        return report_main(rest) or 0
    if command == "export":
        from astralight.export import main as export_main

        return export_main(rest) or 0
    if command == "prepare-toy":
        from astralight.tasks.warmstart import main as prepare_main

        return prepare_main(rest) or 0
    print(f"astralight: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
