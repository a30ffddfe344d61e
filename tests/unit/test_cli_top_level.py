"""The top-level ``astralight`` command: readable help, ``--version``, help of the service
sub-commands, and error tips that name the command a user typed."""

from __future__ import annotations

from pathlib import Path

import pytest

from astralight.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_help_is_plain_text_and_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out  # no reST markup
    for command in ("run", "dataflow serve", "raas serve", "fit", "autoscale", "report",
                    "export", "prepare-toy", "--version"):
        assert f"astralight {command}" in out
    assert main([]) == 2  # no command at all is a usage error (the help on stdout)


def test_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("astralight ") and out.split()[1][0].isdigit()


@pytest.mark.parametrize("command", ["dataflow", "raas"])
def test_service_commands_answer_help_and_name_serve(command, capsys):
    assert main([command, "--help"]) == 0
    assert f"astralight {command} serve --config" in capsys.readouterr().out
    assert main([command]) == 2
    assert f"astralight {command} serve" in capsys.readouterr().err


def test_a_typo_in_a_trainer_config_names_the_key_and_the_real_program(tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  max_step: 3\n")
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(ROOT / "configs" / "toy" / "trainer.yaml"),
              "--config", str(typo)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "trainer.max_step" in err and "astralight fit --help" in err and "cli.py" not in err


def test_flags_are_accepted_with_dashes_or_underscores(tmp_path):
    from astralight.cli import flag_style

    assert flag_style(["--run_dir", "a_b", "--export_configs=x_y", "recipe_1.yaml"], dashes=True) == [
        "--run-dir", "a_b", "--export-configs=x_y", "recipe_1.yaml"]
    assert flag_style(["--trainer.max-steps", "3", "--print-config", "--", "--keep-me"],
                      dashes=False) == ["--trainer.max_steps", "3", "--print_config", "--",
                                        "--keep-me"]
    # through the command: the launcher's own flag spelled with an underscore
    assert main(["run", "--export_configs", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "trainer.yaml").exists()


def test_a_config_key_spelled_with_dashes_reaches_fit(tmp_path, capsys):
    """``--trainer.max-step`` is the same key as ``--trainer.max_step``: the typo is still named."""
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(ROOT / "configs" / "toy" / "trainer.yaml"),
              "--trainer.max-stepz", "3"])
    assert info.value.code == 2
    assert "trainer.max_stepz" in capsys.readouterr().err
