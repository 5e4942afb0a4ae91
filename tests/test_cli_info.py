"""``hbkernels info`` and the command line's entry points."""
import importlib.metadata
import json
import shutil
import subprocess
import sys

import numba
import pytest

import hbkernels
from hbkernels.cli import main
from hbkernels.cli.info import collect_info, format_info

from mpirun import ROOT, _env


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hbkernels", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)


def test_info_prints_versions_devices_backends():
    res = run_cli("info")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for heading in ("versions:", "devices:", "backends:"):
        assert heading in out
    assert f"hbkernels    {hbkernels.__version__}" in out
    assert f"numba        {numba.__version__}" in out
    assert "NumPy arrays -> Numba CPU kernels" in out


def test_info_json_matches_installed_versions():
    res = run_cli("info", "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["versions"]["hbkernels"] == hbkernels.__version__
    assert info["versions"]["numpy"] == importlib.metadata.version("numpy")
    torch = info["versions"]["torch"]
    try:
        assert torch == importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        assert torch is None
    assert info["backends"]["numpy"]["available"] is True
    assert info["cpu"]["cores"] >= 1


def test_info_says_why_cuda_runs_where_it_does(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    info = collect_info(probe_mpi=False)
    assert info["cuda_devices"] == []
    assert info["backends"]["cuda"]["available"] is True    # the simulator runs the CUDA kernels
    assert "simulator" in info["backends"]["cuda"]["why"]
    assert "local" in info["backends"]["dist"]["why"]      # not under mpiexec
    assert "cuda  none" in format_info(info)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in ("info", "check", "bench", "train", "data"):
        assert f"    {command}" in out


def test_data_commands_run_under_hbkernels(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    dst = tmp_path / "synthetic.parquet"
    assert main(["data", "synthetic", str(dst), "--rows", "50", "--table", "user:100:1"]) == 0
    assert dst.exists() and "wrote 50 rows" in capsys.readouterr().out
    assert main(["data", "convert", "criteo", str(tmp_path / "missing.txt"), str(dst)]) == 1
    assert "hbkernels data: error:" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("hbkernels") is None, reason="the console script is not installed")
def test_console_script():
    res = subprocess.run(["hbkernels", "info"], capture_output=True, text=True, timeout=120, env=_env())
    assert res.returncode == 0 and "versions:" in res.stdout


def test_info_shows_numba_runtime_and_hbk_variables(monkeypatch):
    monkeypatch.setenv("HBK_TEST_SETTING", "on")
    info = collect_info(probe_mpi=False)
    assert info["numba"]["threads"] == numba.get_num_threads()
    assert info["numba"]["cache"]["caching"] is True
    assert info["environment"]["HBK_TEST_SETTING"] == "on"
    assert all(k.startswith("HBK_") for k in info["environment"])
    text = format_info(info)
    for line in ("numba:", "thread pools", "threading layer", "kernel cache", "HBK_TEST_SETTING=on"):
        assert line in text, line


def test_output_into_a_closed_pipe_ends_quietly():
    for reader in ("true", "head -1"):
        res = subprocess.run(f"{sys.executable} -m hbkernels info | {reader}; "
                             f"echo status ${{PIPESTATUS[0]}}", shell=True, executable="bash",
                             cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
        assert res.stderr == "", res.stderr
        assert res.stdout.strip().endswith("status 0"), res.stdout


def test_only_hbkernels_user_errors_are_one_line(monkeypatch, capsys):
    from hbkernels.cli import info
    from hbkernels.errors import DataError, MissingDependencyError

    for error in (DataError("column 'x' is missing"), MissingDependencyError("needs pyarrow")):
        def user_error(args, error=error):
            raise error
        monkeypatch.setattr(info, "run", user_error)
        assert main(["info"]) == 1
        assert capsys.readouterr().err == f"hbkernels info: error: {error}\n"
    for bug in (ValueError("a bug"), TypeError("a bug"), KeyError("a bug")):
        def buggy(args, bug=bug):
            raise bug
        monkeypatch.setattr(info, "run", buggy)
        with pytest.raises(type(bug)):   # shown with its traceback by the interpreter
            main(["info"])


def test_version(capsys):
    from hbkernels import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"hbkernels {__version__}"


def _subparsers(parser):
    """``{"train": parser, "data synthetic": parser, ...}`` of every (sub)command."""
    import argparse

    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = sub
                out.update({f"{name} {k}": v for k, v in _subparsers(sub).items()})
    return out


def test_every_help_shows_each_options_default_and_no_flag_has_one():
    """Each option whose default is a value says it in its --help ("(default: ...)"), and
    no flag does (``--no-train (default: True)`` read as if the flag were on)."""
    from hbkernels.cli import build_parser

    for name, sub in _subparsers(build_parser()).items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.help == "==SUPPRESS==":
                continue
            said = formatter._get_help_string(action) or ""
            if action.nargs == 0:  # a flag
                assert "(default" not in said, (name, action.option_strings, said)
            elif action.default not in (None, False):
                assert "default" in said, (name, action.option_strings, said)
        assert "(default: True)" not in sub.format_help(), name
