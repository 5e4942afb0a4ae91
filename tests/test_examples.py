"""The README's main job (examples/embedding_bag_cpu.py) runs and checks itself."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_embedding_bag_cpu_example():
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "embedding_bag_cpu.py")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "matches NumPy" in res.stdout and res.stdout.rstrip().endswith("OK")


def test_readme_python_snippets_run_and_print_what_they_show():
    """The README's Python blocks, in order, as one script (collectives on the local
    backend); each ``print(...)  # result`` prints what it shows."""
    from doc_blocks import blocks, run_and_check

    assert len(blocks(ROOT / "README.md", "python")) >= 3
    run_and_check(ROOT / "README.md")
