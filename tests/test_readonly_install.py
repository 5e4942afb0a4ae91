"""A read-only install: the package directory and ``$HOME`` read-only (a non-root container).

The checkout (this editable install's package directory) and a fresh ``$HOME`` (and, for
the last case, every temporary directory) are bind-mounted read-only in a private mount namespace (``unshare -m``, which needs root;
skipped elsewhere), so Numba's usual cache locations (``__pycache__`` beside the sources,
``~/.cache``) cannot be written. ``import hbkernels`` compiles nothing, the kernels run,
and the cache falls back to a private temporary directory, or to none when the temporary
directory is read-only too.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from mpirun import ROOT, _env

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None,
    reason="read-only bind mounts need root and unshare")

PROBE = textwrap.dedent("""
    import json, numba, numpy as np
    import hbkernels as hbk
    from hbkernels.cpu import embedding_bag as cpu_embedding_bag
    from hbkernels.data import hashing
    from hbkernels._numba_cache import cache_info
    compiled = [name for name, f in vars(hashing).items()
                if isinstance(f, numba.core.dispatcher.Dispatcher) and f.signatures]
    compiled += [name for name, f in vars(cpu_embedding_bag).items()
                 if isinstance(f, numba.core.dispatcher.Dispatcher) and f.signatures]
    out = hbk.embedding_bag(np.eye(3, dtype=np.float32), np.array([0, 2]), np.array([0, 2]))
    ids = np.empty(2, np.int64)
    hashing.fnv1a64_ids(np.array([0, 1, 3]), np.frombuffer(b"abc", np.uint8), 0, ids)
    print(json.dumps({"compiled_at_import": compiled, "pooled": out.tolist(),
                      "ids": ids.tolist(), "cache": cache_info()}))
""")


def run_read_only(tmp_path, *, tmp_read_only=False):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    mounts = [ROOT, home] + ([scratch, "/var/tmp", "/tmp"] if tmp_read_only else [])
    script = " && ".join(f"mount --bind {p} {p} && mount -o remount,bind,ro {p}" for p in mounts)
    env = _env()
    env.pop("NUMBA_CACHE_DIR", None)
    env.update(HOME=str(home), TMPDIR=str(scratch), TEMP=str(scratch), TMP=str(scratch))
    cmd = f"{script} && cd {tmp_path} && exec {sys.executable} -c \"$PROBE\""
    env["PROBE"] = PROBE
    res = subprocess.run(["unshare", "-m", "sh", "-c", cmd], env=env, capture_output=True,
                         text=True, timeout=300)
    if res.returncode != 0 and "mount" in res.stderr and "Traceback" not in res.stderr:
        pytest.skip(f"cannot mount read-only here: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def expected_ids():
    h = 0xCBF29CE484222325
    ids = []
    for s in (b"a", b"bc"):
        h = 0xCBF29CE484222325
        for byte in s:
            h = ((h ^ byte) * 0x100000001B3) % 2**64
        ids.append(h & (2**63 - 1))
    return ids


def test_read_only_package_and_home_fall_back_to_a_private_temporary_cache(tmp_path):
    result = run_read_only(tmp_path)
    assert result["compiled_at_import"] == []
    assert result["pooled"] == [[1.0, 0.0, 1.0]]
    assert result["ids"] == expected_ids()
    cache = result["cache"]
    assert cache["caching"] and cache["numba_cache_dir"] == str(tmp_path / "tmp" / f"hbkernels-numba-{os.getuid()}")
    assert os.listdir(cache["numba_cache_dir"])   # the kernels were cached there
    assert oct(os.stat(cache["numba_cache_dir"]).st_mode & 0o777) == "0o700"


def test_nothing_writable_runs_without_a_cache(tmp_path):
    result = run_read_only(tmp_path, tmp_read_only=True)
    assert result["pooled"] == [[1.0, 0.0, 1.0]] and result["ids"] == expected_ids()
    assert result["cache"]["caching"] is False


def test_a_temporary_directory_someone_else_can_write_is_not_used(tmp_path):
    shared = tmp_path / "tmp" / f"hbkernels-numba-{os.getuid()}"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    result = run_read_only(tmp_path)
    assert result["cache"]["caching"] is False and result["pooled"] == [[1.0, 0.0, 1.0]]
