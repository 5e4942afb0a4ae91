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
