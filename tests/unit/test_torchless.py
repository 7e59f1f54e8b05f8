"""The driver runs no network: its libraries are imported without torch (``gdpo_ray.run.torchless``)."""

import subprocess
import sys
import textwrap
from pathlib import Path

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

    from gdpo_ray.run.torchless import torch_kept_out

    with torch_kept_out():
        import torch as again  # noqa: F401
    assert again is torch and sys.modules["torch"] is torch
