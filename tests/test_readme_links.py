"""README.md is also the package index's project page (pyproject's ``readme``), where relative
links lead nowhere: every link and image in it is an absolute URL, and each one into the
project's repository names a file (or folder) this checkout has."""
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
LINKS = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", README)


def repository():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["urls"]["Source"].rstrip("/")


def test_the_readme_has_links():
    assert len(LINKS) > 10, LINKS


@pytest.mark.parametrize("link", sorted(set(LINKS)))
def test_every_readme_link_is_absolute_and_names_a_file_of_the_checkout(link):
    assert link.startswith("https://"), f"a relative link is dead on the package index: {link}"
    repo = repository()
    raw = repo.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"
    for prefix in (f"{repo}/blob/main/", f"{repo}/tree/main/", raw):
        if link.startswith(prefix):
            path = link[len(prefix):].split("#")[0]
            assert (ROOT / path).exists(), f"{link}: no {path} in the checkout"
