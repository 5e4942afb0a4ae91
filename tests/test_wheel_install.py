"""The wheel, installed non-editable in a fresh venv, from outside the checkout, with the
package directory and ``$HOME`` read-only: ``import hbkernels``, ``hbkernels info``,
``hbkernels bench --smoke`` and ``hbkernels train --steps 20`` work.

The wheel is built from this checkout (``pip wheel --no-build-isolation``, offline) and
installed with ``--no-deps`` into a venv with ``--system-site-packages`` (numpy, numba,
torch come from this Python; when this Python is itself a venv's, whose packages the new
venv's ``--system-site-packages`` would not see, a ``.pth`` file adds this venv's
site-packages after the new venv's own). The venv, the checkout and a fresh ``$HOME`` are
bind-mounted read-only in a private mount namespace (``unshare -m``: needs root, skipped
elsewhere); the commands run in a scratch directory, the only writable place besides the
temporary directory.
"""
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mpirun import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="read-only bind mounts need root and unshare"),
]


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(base / "dist"), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = (base / "dist").glob("hbkernels-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("hbkernels/bench/run_all.py", "hbkernels/bench/common.py", "hbkernels/cli/train.py",
                   "hbkernels/train.py", "hbkernels/sharding/kinds/row_wise.py",
                   "hbkernels/_numba_cache.py"):
        assert module in names, f"{module} is not in the wheel"
    env_dir = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], check=True,
                   timeout=300)
    python = env_dir / "bin" / "python"
    if sys.prefix != sys.base_prefix:  # inside a venv: its packages, after the new venv's
        own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                             check=True, capture_output=True, text=True).stdout.strip()
        Path(own, "outer-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return base, python


def run_read_only(base, python, *commands):
    """Run ``python <args>`` for each of ``commands`` in one read-only namespace; returns
    the completed process (stdout: each command's output after a ``== i`` line)."""
    home, scratch, tmp = base / "home", base / "scratch", base / "tmp"
    for d in (home, scratch, tmp):
        d.mkdir(exist_ok=True)
    mounts = " && ".join(f"mount --bind {p} {p} && mount -o remount,bind,ro {p}"
                         for p in (base / "venv", ROOT, home))
    steps = " && ".join(f"echo == {i} && {python} {args}" for i, args in enumerate(commands))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CACHE_DIR", "PYTHONPATH"))}
    env.update(HOME=str(home), TMPDIR=str(tmp), MPLCONFIGDIR=str(tmp / "mpl"))
    res = subprocess.run(["unshare", "-m", "sh", "-c", f"{mounts} && cd {scratch} && {steps}"],
                         env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0 and "mount" in res.stderr and "Traceback" not in res.stderr:
        pytest.skip(f"cannot mount read-only here: {res.stderr.strip()}")
    return res


def test_wheel_runs_read_only_from_outside_the_checkout(venv):
    base, python = venv
    res = run_read_only(
        base, python,
        "-c 'import hbkernels, os; print(hbkernels.__file__); "
        "open(os.path.join(os.path.dirname(hbkernels.__file__), \"probe\"), \"w\")' "
        "2>&1 | grep -q 'Read-only file system' && echo package-read-only",
        "-c 'import hbkernels; print(hbkernels.__file__)'",
        "-m hbkernels info",
        "-m hbkernels bench --smoke --ops embedding_bag,unique --out bench-out",
        "-m hbkernels train --steps 20 --batch-size 256 --eval-samples 1024 --metrics m.json",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "package-read-only" in out
    imported = out.split("== 1\n")[1].splitlines()[0]
    assert imported.startswith(str(base / "venv")), imported          # the wheel, not the checkout
    assert "kernel cache" in out and "hbkernels-numba-" in out        # info: the fallback cache
    assert "embedding_bag" in out and (base / "scratch" / "bench-out").is_dir()
    assert "20 steps x 256 samples" in out and (base / "scratch" / "m.json").exists()
    assert "Traceback" not in res.stderr
