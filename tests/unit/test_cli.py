"""The `trainer` console script: every subcommand is listed and answers --help."""

import pytest

from trainer import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"  {name} " in out, name


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_each_command_answers_help(name, capsys):
    try:
        code = cli.main([name, "--help"])
    except SystemExit as e:  # argparse exits after printing help
        code = e.code
    assert code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()


def test_unknown_command(capsys):
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
