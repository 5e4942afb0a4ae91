"""The GPU extras of pyproject.toml (``cuda12``, ``cuda13``) and the torch that README.md
and docs/README.md install with each.

Each extra names CuPy, numba-cuda and the NCCL wheel (``nvidia-nccl-cuXX``, where CuPy >= 13.5
loads ``libnccl.so.2`` from) of one CUDA major, and resolves from PyPI alone with its torch: on
PyPI, torch up to 2.10 is built for CUDA 12 and torch 2.11 and later for CUDA 13.

The first tests read pyproject.toml and README.md (offline). The resolution tests run
``pip install --dry-run --report`` against https://pypi.org/simple only (pip's configured extra
indexes and find-links, such as a local CPU torch wheel, are switched off). They need a pip that
fetches metadata, not wheels (a few MB instead of several GB of CUDA wheels): pip >= 25.3 with
``--use-feature=fast-deps`` (HTTP range requests); under an older pip they run pip's own wheel,
fetched from PyPI. They are skipped when PyPI cannot be reached and off Linux (the CUDA wheels'
markers name Linux).
"""
import importlib.metadata
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple"
MAJORS = (12, 13)
# a torch version on each side of PyPI's CUDA 12 -> 13 switch (metadata of the cp311 Linux wheels)
LAST_CUDA12_TORCH, FIRST_CUDA13_TORCH = "2.10.0", "2.11.0"
# wheels whose version's major is the CUDA major (those of cuFFT, cuSPARSE... are not)
CUDA_VERSIONED = ("cuda-bindings", "cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc",
                  "nvidia-nvjitlink", "nvidia-nvvm", "nvidia-cuda-nvcc")


def _pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def extra(major):
    """``{canonical name: Requirement}`` of the ``cuda<major>`` extra."""
    reqs = [Requirement(r) for r in _pyproject()["optional-dependencies"][f"cuda{major}"]]
    return {canonicalize_name(r.name): r for r in reqs}


def documented_torch(page):
    """``{major: torch requirement}`` of the ``pip install -e ".[cudaXX]" "torch..."`` lines."""
    lines = re.findall(r'pip install -e "\.\[cuda(\d+)\]" "(torch[^"]*)"', page.read_text())
    return {int(major): Requirement(torch) for major, torch in lines}


# -- offline: what pyproject.toml and the install docs say ------------------------------------

@pytest.mark.parametrize("major", MAJORS)
def test_the_cuda_extra_names_cupy_numba_cuda_and_nccl_of_one_cuda_major(major):
    reqs = extra(major)
    assert f"cupy-cuda{major}x" in reqs, sorted(reqs)
    assert reqs["numba-cuda"].extras == {f"cu{major}"}, str(reqs["numba-cuda"])
    nccl = reqs.get(f"nvidia-nccl-cu{major}")
    assert nccl is not None, f"cuda{major} brings no nvidia-nccl-cu{major}: {sorted(reqs)}"
    linux = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    assert nccl.marker is None or nccl.marker.evaluate(linux), str(nccl)
    assert nccl.specifier.contains("2.30.0"), str(nccl)  # NCCL 2, a current release
    other = {12: 13, 13: 12}[major]
    for name, req in reqs.items():
        assert not re.search(rf"cu(da)?{other}", name + str(sorted(req.extras))), (
            f"cuda{major} names a CUDA {other} package: {req}")
    torch = reqs.get("torch")  # a torch range would be allowed; an exact pin is not
    assert torch is None or not any(s.operator in ("==", "===") for s in torch.specifier)


@pytest.mark.parametrize("page", ["README.md", "docs/README.md"])
def test_the_install_docs_pair_each_cuda_extra_with_a_torch_of_its_major(page):
    torch = documented_torch(ROOT / page)
    assert set(torch) == set(MAJORS), f"{page}: install lines for {sorted(torch)}"
    assert torch[12].specifier.contains(LAST_CUDA12_TORCH), str(torch[12])
    assert not torch[12].specifier.contains(FIRST_CUDA13_TORCH), str(torch[12])
    assert torch[13].specifier.contains(FIRST_CUDA13_TORCH), str(torch[13])
    assert not torch[13].specifier.contains(LAST_CUDA12_TORCH), str(torch[13])


# -- online: pip resolves each extra with its documented torch from PyPI -----------------------

def _pypi_unreachable():
    """None when PyPI's simple index answers within a few seconds, else why not."""
    cafile = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    try:
        context = ssl.create_default_context(cafile=cafile if cafile and os.path.isfile(cafile)
                                             else None)
        with urllib.request.urlopen(f"{PYPI}/pip/", timeout=5, context=context) as r:
            r.read(1)
    except Exception as e:  # no network, a proxy refusing, DNS, TLS...
        return f"PyPI is not reachable ({type(e).__name__}: {e})"
    return None


def _pip_env():
    """The environment without pip's configuration: PyPI only, no find-links, no extra indexes
    (what pip needs to reach it, certificates and proxies, stays)."""
    keep = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_TRUSTED_HOST", "PIP_CACHE_DIR",
            "PIP_DEFAULT_TIMEOUT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _metadata_only_pip(tmp):
    """The command of a pip whose ``--dry-run`` downloads no wheel (pip >= 25.3: pypa/pip#12603):
    this interpreter's pip, or else pip's own wheel fetched from PyPI and run from the zip."""
    if Version(importlib.metadata.version("pip")).release >= (25, 3):
        return [sys.executable, "-m", "pip"]
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           "--only-binary=:all:", "--index-url", PYPI, "--dest", str(tmp),
                           "pip>=25.3"], env=_pip_env(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=120)
    wheels = sorted(tmp.glob("pip-*.whl"))
    if proc.returncode or not wheels:
        pytest.skip(f"no pip >= 25.3 (its --dry-run downloads every wheel): {proc.stdout[-500:]}")
    return [sys.executable, f"{wheels[-1]}/pip"]


def _dry_run(pip, requirements, report):
    cmd = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--only-binary=:all:",
           "--use-feature=fast-deps", "--index-url", PYPI, "--report", str(report), *requirements]
    proc = subprocess.run(cmd, env=_pip_env(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=300)
    if proc.returncode and "fast-deps" in proc.stdout and "invalid choice" in proc.stdout:
        pytest.skip("this pip has no fast-deps; without it, an index without PEP 658 metadata "
                    "makes --dry-run download every wheel")
    picked = {}
    if proc.returncode == 0:
        for item in json.loads(report.read_text())["install"]:
            meta = item["metadata"]
            picked[canonicalize_name(meta["name"])] = (meta["version"],
                                                       item["download_info"]["url"])
    return proc.returncode, proc.stdout, picked


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory):
    """``{major: (pip's exit status, its output, {name: (version, url)})}`` of
    ``pip install --dry-run <hbkernels' dependencies> <the cuda extra> <its documented torch>``."""
    if sys.platform != "linux":
        pytest.skip("the CUDA wheels' markers name Linux; pip evaluates them for this platform")
    reason = _pypi_unreachable()
    if reason:
        pytest.skip(reason)
    torch = documented_torch(ROOT / "README.md")
    out = tmp_path_factory.mktemp("extras")
    pip = _metadata_only_pip(out)
    base = _pyproject()["dependencies"]
    with ThreadPoolExecutor(len(MAJORS)) as pool:
        jobs = {m: pool.submit(_dry_run, pip, [*base, *map(str, extra(m).values()), str(torch[m])],
                               out / f"cuda{m}.json") for m in MAJORS}
        try:
            return {m: job.result() for m, job in jobs.items()}
        except subprocess.TimeoutExpired as e:
            pytest.skip(f"PyPI too slow: {e}")


@pytest.mark.slow
@pytest.mark.parametrize("major", MAJORS)
def test_the_cuda_extra_resolves_from_pypi_with_its_torch_and_nccl(major, resolutions):
    rc, output, picked = resolutions[major]
    assert rc == 0, f"cuda{major} with its torch does not resolve from PyPI:\n{output[-4000:]}"
    torch_version, torch_url = picked["torch"]
    assert documented_torch(ROOT / "README.md")[major].specifier.contains(torch_version)
    assert Version(torch_version).local is None and not torch_url.startswith("file:"), (
        f"not PyPI's torch: {torch_version} {torch_url}")
    assert f"cupy-cuda{major}x" in picked and "numba-cuda" in picked, sorted(picked)
    assert f"nvidia-nccl-cu{major}" in picked, f"no NCCL wheel: {sorted(picked)}"
    other = {12: 13, 13: 12}[major]
    mixed = sorted(n for n in picked if n.endswith(f"-cu{other}") or n == f"cupy-cuda{other}x")
    mixed += sorted(f"{n} {picked[n][0]}" for n in CUDA_VERSIONED
                    if n in picked and Version(picked[n][0]).major != major)
    assert not mixed, f"cuda{major} with torch {torch_version} mixes in CUDA {other}: {mixed}"
