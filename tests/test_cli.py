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
