import subprocess
import sys

from nla import __version__
from nla.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "nla.cli", "--help"], capture_output=True, text=True, check=True)
    assert "quickstart" in out.stdout


def test_bad_input_is_one_clear_line_and_exit_code_2(capsys):
    assert main(["rl", "--set", "steps=3"]) == 2
    err = capsys.readouterr().err
    assert "nla rl: error: RLConfig.av: expected a path" in err and "Traceback" not in err
