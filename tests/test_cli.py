import subprocess
import sys

import pytest

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


# Issue 48: docs/index.md ("CPU threads") says every command takes --threads; these lacked it.
THREAD_COMMANDS = {
    "verbalize": ["verbalize", "--av", "{tmp}/no-av", "--vectors", "{tmp}/v.npy"],
    "eval": ["eval", "--ar", "{tmp}/no-ar", "--dataset", "{tmp}/d.parquet"],
    "score": ["score", "--ar", "{tmp}/no-ar", "--texts", "{tmp}/t.txt", "--vectors", "{tmp}/v.npy"],
    "explore": ["explore", "--av", "{tmp}/no-av", "--ar", "{tmp}/no-ar"],
    "world build": ["world", "build", "--preset", "tiny", "--out", "{tmp}/w"],
    "world probe": ["world", "probe", "--preset", "tiny", "--out", "{tmp}/w"],
}


@pytest.mark.parametrize("name", sorted(THREAD_COMMANDS))
def test_every_model_command_takes_and_applies_threads(name, tmp_path, capsys, monkeypatch):
    import nla.util.threads as threads

    applied = []

    def record(requested=None, *, processes=1):
        applied.append(requested)
        raise ValueError(f"threads applied: {requested!r}")  # stop before any model or world loads

    monkeypatch.setattr(threads, "apply_threads", record)
    argv = [a.format(tmp=tmp_path) for a in THREAD_COMMANDS[name]]
    for value, parsed in (("1", 1), ("auto", "auto")):
        assert main([*argv, "--threads", value]) == 2
        assert capsys.readouterr().err == f"nla {argv[0]}: error: threads applied: {parsed!r}\n"
    assert main(argv) == 2  # without the flag: the shared default ($OMP_NUM_THREADS, else every core)
    capsys.readouterr()
    assert applied == [1, "auto", None]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--threads", "0"])
    assert exc.value.code == 2
    assert "argument --threads: expected a positive integer or 'auto', found 0" in capsys.readouterr().err


def test_verbalize_threads_reach_torch(tmp_path, capsys):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["verbalize", "--av", str(tmp_path / "no-av"), "--vectors", str(tmp_path / "v.npy"),
                     "--threads", "1"]) == 2  # the missing vectors file stops it after the threads are set
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_explore_refuses_a_port_in_use_before_printing_the_link(tmp_path, capsys):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["explore", "--av", str(tmp_path / "av"), "--ar", str(tmp_path / "ar"), "--port", str(port)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err == (f"nla explore: error: --port: cannot listen on 127.0.0.1:{port} (Address already in use); "
                            "another program uses the port: stop it or pass another --port\n")
    assert "open http" not in captured.out + captured.err


def test_explore_on_all_interfaces_answers_the_machines_own_addresses(monkeypatch):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from nla.util import http as explore  # the explorer's and nla serve's allow-list
    from nla.util.http import HostAllowList

    own = explore.interface_addresses()
    assert "127.0.0.1" in own
    hosts = explore.allowed_hosts("0.0.0.0", [])
    assert own <= set(hosts)
    # an interface address getaddrinfo(hostname) does not return (the case that was refused)
    monkeypatch.setattr(explore, "interface_addresses", lambda: {"127.0.0.1", "192.0.2.2", "fd00::2"})
    hosts = explore.allowed_hosts("0.0.0.0", [])
    assert {"192.0.2.2", "fd00::2"} <= set(hosts) and "192.0.2.2" not in explore.allowed_hosts("127.0.0.1", [])
    app = HostAllowList(Starlette(routes=[Route("/", lambda r: PlainTextResponse("ok"))]), hosts)
    client = TestClient(app)
    assert client.get("/", headers={"Host": "192.0.2.2:8765"}).text == "ok"
    assert client.get("/", headers={"Host": "[fd00::2]:8765"}).text == "ok"
    assert client.get("/", headers={"Host": "evil.example:8765"}).status_code == 400


def test_a_full_disk_names_the_path_and_what_to_do():
    """A full disk said only "[Errno 28] No space left on device", no path (issue 58)."""
    import errno

    from nla.cli import os_error_message

    assert os_error_message(OSError(errno.ENOSPC, "No space left on device", "/runs/x/rl.jsonl"), "/runs/x") == (
        "the disk is full (/runs/x/rl.jsonl): No space left on device; free space on that filesystem (or a quota), "
        "or write to another --out, then rerun (finished stages and checkpoints are kept)")
    assert os_error_message(OSError(errno.ENOSPC, "No space left on device"), "/runs/x").startswith(
        "the disk is full (writing under --out /runs/x): No space left on device;")
    assert os_error_message(OSError(errno.EACCES, "Permission denied", "/etc/x"), None) == (
        "permission denied (/etc/x): Permission denied; fix the permissions or choose another path")
    assert os_error_message(FileNotFoundError("--run: no directory at /x"), None) == "--run: no directory at /x"
