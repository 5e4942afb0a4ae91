"""The extras of pyproject.toml and the install commands of README.md, docs/README.md and .ci/run.

Extras name ranges, never exact pins (those live in .ci/constraints.txt, which the README's test
command and .ci/run use), so hbkernels installs beside the torch a user already has: the torch
extras resolve with torch 2.12, 2.13 and 2.14. ``mpi`` uses the machine's MPI, ``mpi-wheel``
brings MPICH's wheel; ``tf`` names ``tensorflow`` (never a second TensorFlow build beside it).

The GPU extras (``cuda12``, ``cuda13``) are paired with the torch README.md and docs/README.md
install with each.

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


def extras():
    return {name: {canonicalize_name(Requirement(r).name): Requirement(r) for r in reqs}
            for name, reqs in _pyproject()["optional-dependencies"].items()}


def test_no_extra_pins_an_exact_version():
    pinned = [f"[{name}] {req}" for name, reqs in extras().items() for req in reqs.values()
              if any(s.operator in ("==", "===") for s in req.specifier)]
    assert not pinned, f"exact pins belong in .ci/constraints.txt: {pinned}"


def test_mpi_uses_the_machines_mpi_and_mpi_wheel_brings_mpich():
    assert set(extras()["mpi"]) == {"mpi4py"}, extras()["mpi"]
    assert set(extras()["mpi-wheel"]) == {"mpi4py", "mpich"}, extras()["mpi-wheel"]


def test_tf_names_one_tensorflow_build():
    assert set(extras()["tf"]) == {"tensorflow"}, extras()["tf"]


def _readme_test_command():
    commands = re.findall(r"^python3 -m pip install [^\n]*&& python3 -m pytest -n auto$",
                          (ROOT / "README.md").read_text(), re.M)
    assert len(commands) == 1, commands
    return commands[0]


def test_ci_runs_the_readmes_test_command_with_the_constraints():
    command = _readme_test_command()
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    assert command.count("-c .ci/constraints.txt") == command.count("pip install"), command
    pins = {canonicalize_name(Requirement(line).name): Requirement(line)
            for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    assert str(pins["torch"].specifier) == "==2.13.0", pins["torch"]


def test_the_readme_installs_non_editable_too():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r'pip install "\.\[train\]"', readme), "no non-editable install line"
    assert re.search(r'pip install -e "\.\[train\]"', readme), "no editable install line"


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


TORCHES = ("2.12.0", "2.13.0", "2.14.0")
TORCH_EXTRAS = ("torch", "train", "bench")


@pytest.fixture(scope="module")
def torch_resolutions(tmp_path_factory):
    """``{torch version: (pip's exit status, its output, {name: (version, url)})}`` of
    ``pip install --dry-run <hbkernels' dependencies> <the torch, train and bench extras>
    torch==<version>`` against PyPI."""
    if sys.platform != "linux":
        pytest.skip("resolved for Linux wheels")
    reason = _pypi_unreachable()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("torch-extras")
    pip = _metadata_only_pip(out)
    reqs = [*_pyproject()["dependencies"],
            *{str(r) for e in TORCH_EXTRAS for r in extras()[e].values()}]
    with ThreadPoolExecutor(len(TORCHES)) as pool:
        jobs = {v: pool.submit(_dry_run, pip, [*reqs, f"torch=={v}"], out / f"torch-{v}.json")
                for v in TORCHES}
        try:
            return {v: job.result() for v, job in jobs.items()}
        except subprocess.TimeoutExpired as e:
            pytest.skip(f"PyPI too slow: {e}")


@pytest.mark.slow
@pytest.mark.parametrize("version", TORCHES)
def test_the_torch_extras_resolve_beside_a_users_torch(version, torch_resolutions):
    rc, output, picked = torch_resolutions[version]
    assert rc == 0, f"[torch,train,bench] with torch=={version} does not resolve:\n{output[-4000:]}"
    assert picked["torch"][0] == version, picked["torch"]
    assert {"numba", "numpy", "pyarrow", "pandas", "matplotlib"} <= set(picked), sorted(picked)


def test_package_metadata_names_its_license_urls_and_classifiers():
    project = _pyproject()
    assert project["license"] == "Apache-2.0" and "LICENSE" in project["license-files"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert {"Homepage", "Documentation", "Source"} <= set(project["urls"]), project["urls"]
    assert all(u.startswith("https://") for u in project["urls"].values()), project["urls"]
    assert any(c.startswith("Programming Language :: Python :: 3") for c in project["classifiers"])
