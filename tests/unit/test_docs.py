"""The docs cannot rot: the configuration reference is the generator's output for the field table
as it is now, the site builds with ``mkdocs build --strict`` (broken links and anchors fail it),
and every relative link of the README (the front page) points to a file that exists."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_generated_from_the_field_table():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == _config_reference().render(), (
        "docs/configuration.md differs from the field table in gdpo_ray/config.py; regenerate it: "
        "python scripts/config_reference.py > docs/configuration.md")


def test_configuration_reference_names_every_field():
    from gdpo_ray.config import FIELDS, RLLIB_FIELDS

    text = _config_reference().render()
    missing = [name for name in (*FIELDS, *RLLIB_FIELDS) if f"| `{name}` |" not in text]
    assert missing == []


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "configuration" / "index.html").exists()


def test_readme_links_point_to_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [t.split("#")[0] for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]
    assert relative, "the README links into docs/"
    broken = [t for t in relative if not (ROOT / t).exists()]
    assert broken == [], f"README.md links to files that do not exist: {broken}"
