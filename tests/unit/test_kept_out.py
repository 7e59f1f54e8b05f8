"""Imports made as if a package were not installed (``gdpo_ray.kept_out``): the driver's libraries
without torch (it runs no network), a package's modules refused while kept out and importable after."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent("""
    import sys
    from pathlib import Path

    from gdpo_ray.run.cli import main  # the command's own imports: RLlib, Tune, the loggers
    from gdpo_ray.run.loggers import TensorBoardLog
    from gdpo_ray.run.presets import apply_sections, load_preset
    from gdpo_ray import GDPOConfig

    config = apply_sections(GDPOConfig(), load_preset("demo", []))
    config.validate()  # RLlib's own checks too
    log = TensorBoardLog(Path(sys.argv[1]), "demo", {"training": {"lr": 1.0}})
    log.log(1, {"rewards/format/mean": 0.5})
    assert "torch" not in sys.modules, "the driver imported torch"
    import torch  # still importable as usual afterwards
    print("ok", torch.tensor([1.0]).item())
""")


def test_the_drivers_imports_and_config_checks_leave_torch_out(tmp_path):
    done = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "1.0"]
    assert list((tmp_path / "tensorboard").iterdir())  # the events file was written


def test_an_imported_torch_is_left_as_it_is():
    import torch

    from gdpo_ray.kept_out import kept_out

    with kept_out("torch"):
        import torch as again  # noqa: F401
    assert again is torch and sys.modules["torch"] is torch


def test_a_kept_out_package_and_its_modules_are_absent_until_the_block_ends(tmp_path, monkeypatch):
    import importlib
    import importlib.util

    from gdpo_ray.kept_out import kept_out

    (tmp_path / "keptpkg").mkdir()
    (tmp_path / "keptpkg" / "__init__.py").write_text("VALUE = 1\n")
    (tmp_path / "keptpkg" / "sub.py").write_text("VALUE = 2\n")
    (tmp_path / "keptpkg_other.py").write_text("VALUE = 3\n")  # a name that only starts alike
    monkeypatch.syspath_prepend(str(tmp_path))
    with kept_out("keptpkg"):
        for name in ("keptpkg", "keptpkg.sub"):
            with pytest.raises(ModuleNotFoundError) as err:
                importlib.import_module(name)
            assert err.value.name == "keptpkg"  # a module of it: its package is not there
        with pytest.raises(ModuleNotFoundError):  # asked without importing, the same answer
            importlib.util.find_spec("keptpkg")
        assert importlib.import_module("keptpkg_other").VALUE == 3
    assert importlib.import_module("keptpkg.sub").VALUE == 2 and sys.modules["keptpkg"].VALUE == 1
    assert not any(type(finder).__name__ == "_NotInstalled" for finder in sys.meta_path)
    for name in ("keptpkg", "keptpkg.sub", "keptpkg_other"):
        sys.modules.pop(name, None)
