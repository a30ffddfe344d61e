"""The ``astralight`` command: one entry point, one sub-command per process kind.

    astralight run [RECIPE.yaml]                 start everything on this machine (the launcher)
    astralight --version                         the installed version
    astralight run --resume RUN_DIR              continue an interrupted run folder
    astralight run --check [RECIPE.yaml]         check the recipe, every component config and
                                                 local path in seconds; starts nothing
    astralight dataflow serve --config X.yaml    the dataflow service
    astralight raas serve --dataflow URL --config X.yaml   a rollout service
    astralight fit --config X.yaml               a trainer (LightningCLI), one per policy
    astralight autoscale --dataflow URL --raas-config X.yaml --min N --max N   grow or shrink
                                                 the RaaS pool from the balance report
    astralight report RUN_DIR [--viewer|--serve]  plots, a text summary, the rollout viewer
    astralight export CKPT --out DIR [--model-path BASE] [--dtype bfloat16|float32|float16]
                      [--merge-lora] [--force]   a trainer checkpoint (file or FSDP2 folder) as a
                                                 Hugging Face model folder (or a LoRA adapter)
    astralight prepare [RECIPE] [--run-dir RUN]  run a recipe's prepare step alone, then exit
    astralight prepare-toy DIR                   build the toy recipe's warm-started tiny policy

Sub-commands import their component lazily, so ``astralight fit`` never imports vLLM and
``astralight raas`` never imports Lightning.

A broken torch extension (vLLM's CPU wheel installs CUDA builds of torchvision, torchaudio and
torchcodec next to the CPU torch; Lightning's torchmetrics and transformers import them) fails
deep inside an import, e.g. ``RuntimeError: operator torchvision::nms does not exist``; every
sub-command turns that into one line with the fix (:data:`TORCH_EXTRAS_FIX`) and exit status 2.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

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


#: torch extension packages that vLLM's CPU wheel pulls in as CUDA builds (PyPI has no CPU
#: build of them for the pinned torch 2.13.0+cpu: its torchvision 0.28.0 links libcudart.so.13)
TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
#: the one-line fix for a broken torch extension (the README's install step)
TORCH_EXTRAS_FIX = "pip uninstall -y torchvision torchaudio torchcodec"


def broken_torch_extra(exc: BaseException) -> tuple[str, BaseException] | None:
    """``(package, the exception that shows it)`` when a failure came from a broken torch
    extension (one of :data:`TORCH_EXTRAS`), else None.

    A broken build shows as ``operator torchvision::nms does not exist`` (its ops never
    registered), or as any exception raised inside one of those packages (a missing CUDA
    library, an undefined symbol) while something imported it; transformers re-raises it as a
    vague "Could not import module", so the causes are followed too. Only the exception and its
    causes are looked at, so this costs nothing until something has failed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (RuntimeError, OSError, ImportError, AttributeError)):
            text = str(exc)
            for name in TORCH_EXTRAS:
                if f"{name}::" in text:
                    return name, exc
            for frame, _ in traceback.walk_tb(exc.__traceback__):
                parts = Path(frame.f_code.co_filename).parts
                for name in TORCH_EXTRAS:
                    if name in parts:
                        return name, exc
        exc = exc.__cause__ or exc.__context__
    return None


def _torch_extra_error(command: str, name: str, exc: BaseException) -> int:
    """Say what broke, and the fix on a line of its own (stderr); exit status 2."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    print(f"astralight {command}: the installed {name} does not match torch "
          f"({type(exc).__name__}: {first[:200]}). vLLM's CPU wheel installs CUDA builds of "
          "torchvision, torchaudio and torchcodec that break imports; astralight needs none of "
          f"them. Fix:\n    {TORCH_EXTRAS_FIX}", file=sys.stderr)
    return 2


#: what ``astralight fit`` with no arguments prints (LightningCLI's own usage would offer
#: ``{fit,validate,test,predict}`` under the wrong program name)
FIT_USAGE = ("usage: astralight fit --config TRAINER.yaml [--section.key VALUE ...]\n"
             "       astralight fit --help   (every option)\n"
             "A trainer needs a config: `astralight run --export-configs DIR RECIPE` writes one "
             "per policy (DIR/trainer.yaml), and `astralight run` starts it for you.")


def _fit(argv: list[str]) -> int:
    from astralight.dataflow.client import DataflowStopped, DataflowUnreachable, wake_on_sigterm

    if not argv:
        print(FIT_USAGE, file=sys.stderr)
        return 2
    from astralight.trainer.trainer_cli import main as fit_main

    wake_on_sigterm()  # a SIGTERM wakes a wait for an unreachable dataflow (see the client)
    try:
        fit_main(argv)
    except DataflowStopped as exc:
        print(f"astralight fit: stopped: {exc}", file=sys.stderr)
        return 143  # 128 + SIGTERM, as the signal's default action would have ended it
    except DataflowUnreachable as exc:
        print(f"astralight fit: {exc}. Is the dataflow service running at that address? (the "
              "trainer config's data.init_args.dataflow_url)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; returns the exit status (2: usage error, or a broken torch
    extension: see :func:`broken_torch_extra`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except (RuntimeError, OSError, ImportError, AttributeError) as exc:
        found = broken_torch_extra(exc)
        if found is None:
            raise
        return _torch_extra_error(argv[0] if argv else "", *found)


def _main(argv: list[str]) -> int:
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
        from astralight.trainer.export import main as export_main

        return export_main(rest) or 0
    if command == "prepare":
        from astralight.launch.prepare import main as prepare_recipe_main

        return prepare_recipe_main(rest) or 0
    if command == "prepare-toy":
        from astralight.tasks.warmstart import main as prepare_main

        return prepare_main(rest, prog="astralight prepare-toy") or 0
    print(f"astralight: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
