"""The user guide in docs/ runs: every ```python block of a page, in order, as one
script in a fresh namespace, with the current directory a fresh temporary one
(files the examples write land there; ``tests/data`` is linked into it, so the
examples name the sample data as a user at the repository root would).

Each ``print(...)  # result`` must print what its comment shows (:mod:`doc_blocks`).
Fences other than exactly ```python (``python-gpu`` for GPU-only snippets,
``bash``, ``text``) are shown, not run -- except migrating.md's ``python-torchrec``
and ``python-fbgemm`` blocks, run where those libraries are installed, and the
commands these tests pick out of the pages: the ``python3 -m hbkernels.data`` command lines of data.md,
and the ``mpiexec -n N python -m mpi4py examples/...`` line of collectives.md,
which runs under mpiexec with a wall-clock limit (skipped without mpiexec /
mpi4py). A page whose examples import an optional package (torch, jax,
tensorflow, pyarrow) is skipped when it is missing.
"""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import FENCE, blocks, run_and_check, script, shows
from mpirun import HAVE_MPI4PY, MPIEXEC, assert_ok, mpirun

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
OPTIONAL = ("torch", "jax", "tensorflow", "pyarrow", "keras")
IMPORT = re.compile(r"^\s*(?:import|from)\s+(" + "|".join(OPTIONAL) + r")\b", re.M)
# packages a page needs without importing them itself (hbk.data reads Parquet with pyarrow)
INDIRECT = {"data.md": ("pyarrow",)}


RUNNABLE = [p for p in PAGES if blocks(p, "python")]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A fresh working directory that looks like the repository root to the examples."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "data").symlink_to(ROOT / "tests" / "data", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # for the examples' subprocesses
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    return tmp_path


def test_the_guide_has_its_pages():
    names = {p.name for p in PAGES}
    expected = {"README.md", "kernels.md", "optimizers.md", "collectives.md", "sharding.md",
                "data.md", "adapters.md"}
    assert expected <= names, f"missing pages: {sorted(expected - names)}"
    index = (DOCS / "README.md").read_text()
    for name in sorted(names - {"README.md"}):
        assert f"]({name})" in index, f"docs/README.md does not link {name}"
        assert blocks(DOCS / name, "python"), f"{name} has no runnable example"


def _anchors(page):
    """GitHub's ids of the headings of ``page``: lower case, punctuation dropped, spaces -> '-'."""
    text = FENCE.sub("", page.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_between_pages_resolve():
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            resolved = (page.parent / target).resolve() if target else page
            if "://" in target or ROOT not in resolved.parents:
                continue  # the web, or outside the repository
            assert resolved.exists(), f"{page.name} links to a missing {target}"
            if anchor and resolved.suffix == ".md":
                assert anchor in _anchors(resolved), f"{page.name}: no #{anchor} in {target or page.name}"


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_page_examples_run_and_print_what_they_show(page, user_dir):
    """Every example runs, and each `print(...)  # result` prints what its comment shows."""
    code = script(page)
    for module in sorted(set(IMPORT.findall(code)) | set(INDIRECT.get(page.name, ()))):
        pytest.importorskip(module)
    run_and_check(page)


# migrating.md's blocks of the libraries it stands beside, run where they are installed
PEERS = {"python-torchrec": "torchrec", "python-fbgemm": "fbgemm_gpu"}


def test_the_peers_blocks_of_migrating_md_run_and_agree(user_dir):
    """Its TorchRec and FBGEMM blocks, each library's where it is installed, run after the
    hbkernels blocks before them (one script, in page order) and print what they show:
    both sides' numbers agree."""
    pytest.importorskip("torch")
    page = DOCS / "migrating.md"
    assert all(blocks(page, lang) for lang in PEERS), "a peer's blocks are missing"
    here = [lang for lang, module in PEERS.items() if _importable(module)]
    if not here:
        pytest.skip("neither torchrec nor fbgemm_gpu is installed")
    run_and_check(page, ("python", *here))


def _importable(module):
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None and bool(__import__(module))
    except Exception:  # noqa: BLE001 - a broken install is not installed
        return False


def test_a_shown_result_is_checked():
    assert shows("[3, 7, 9]", "[3, 7, 9]") and shows("[-1, 0]", "[-1, 0]: a lookup alone")
    assert shows("values[1] = 9 is out of range [0, 6) in embedding_bag", "values[1] = 9 is out of range [0, 6)")
    assert shows("expected a NumPy array or a CUDA array (CuPy, ...), got builtins.list",
                 "expected a NumPy array or a CUDA array (...), got builtins.list")
    assert not shows("[3, 7, 8]", "[3, 7, 9]") and not shows("None", "IndexedSlices [0, 3]")
    assert not shows("[1.0]", "sum")


def _data_commands():
    """The ``python3 -m hbkernels.data ...`` command lines of data.md's bash blocks."""
    return [line.strip() for _, code in blocks(DOCS / "data.md", "bash")
            for line in code.splitlines() if line.strip().startswith("python3 -m hbkernels.data")]


def test_data_command_lines_run(user_dir):
    pytest.importorskip("pyarrow")
    commands = _data_commands()
    assert commands, "data.md shows no python3 -m hbkernels.data command"
    for command in commands:
        argv = shlex.split(command.split("#")[0])
        res = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, f"{command}\n{res.stdout}\n{res.stderr}"
        assert res.stdout.startswith("wrote "), res.stdout


@pytest.mark.skipif(not (MPIEXEC and HAVE_MPI4PY),
                    reason="needs mpiexec and mpi4py (pip install 'hbkernels[mpi]')")
def test_two_rank_example_runs_under_mpiexec():
    """The launch line collectives.md shows, run as shown (bounded: a hang fails)."""
    launches = [re.match(r"mpiexec -n (\d+) python -m mpi4py (examples/\S+\.py)\s*$", line.strip())
                for _, code in blocks(DOCS / "collectives.md", "bash") for line in code.splitlines()]
    launches = [m for m in launches if m]
    assert launches, "collectives.md shows no `mpiexec -n N python -m mpi4py examples/...` line"
    for m in launches:
        n, script_path = int(m.group(1)), ROOT / m.group(2)
        assert script_path.exists(), script_path
        rc, out, _ = mpirun(n, script_path, timeout=180)
        assert_ok(rc, out, range(n))
