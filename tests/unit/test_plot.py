"""`gdpo-ray plot`: runs' curves side by side, one panel per reward (the union over runs) and per
--metric, each run one line labelled by its name and estimator; clear errors for a directory
that is not a run and a metric that no run logged."""

import json
import math
import sys

import pytest

from gdpo_ray.run.cli import main
from gdpo_ray.run.plot_command import plot_runs
from gdpo_ray.run.run_curves import curves


def fake_run(root, name, rows, estimator=None):
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if estimator is not None:  # the run's config, in preset format
        (run / "config.yaml").write_text(f"training:\n  estimator: {estimator}\n  lr: 1.0e-05\nrun:\n  steps: 3\n")
    return run


@pytest.fixture
def runs(tmp_path):
    gdpo = fake_run(tmp_path, "gdpo-1", [
        {"step": 1, "time": 1.0, "rewards/format/mean": 0.1, "rewards/correct/mean": 0.0, "adv/format/share": 0.9},
        {"step": 2, "time": 2.0, "rewards/format/mean": 0.5, "rewards/correct/mean": 0.2, "adv/format/share": 0.6},
        {"step": 2, "time": 3.0, "rewards/format/mean": 0.6, "rewards/correct/mean": 0.25, "adv/format/share": 0.5},
    ], estimator="gdpo")  # step 2 was redone (a resume): its latest row counts
    grpo = fake_run(tmp_path, "grpo-1", [
        {"step": 1, "time": 1.0, "rewards/format/mean": 0.2, "rewards/length/mean": 0.7},
        {"step": 2, "time": 2.0, "rewards/format/mean": 0.4, "rewards/length/mean": 0.8},
    ], estimator="grpo")
    plain = fake_run(tmp_path, "older", [{"step": 1, "time": 1.0, "rewards/format/mean": 0.3}])  # no config.yaml
    return gdpo, grpo, plain


def drawn(panels):
    return {p.title: [(line.label, line.steps, line.values) for line in p.lines] for p in panels}


def test_one_panel_per_reward_over_all_runs_and_per_metric(runs, tmp_path):
    out = tmp_path / "figs" / "cmp.png"
    panels = plot_runs(runs, ["adv/format/share"], out)
    assert out.stat().st_size > 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.key for p in panels] == ["rewards/format/mean", "rewards/correct/mean", "rewards/length/mean",
                                       "adv/format/share"]
    assert drawn(panels) == {
        "format": [("gdpo-1 (GDPO)", (1, 2), (0.1, 0.6)), ("grpo-1 (GRPO)", (1, 2), (0.2, 0.4)),
                   ("older", (1,), (0.3,))],
        "correct": [("gdpo-1 (GDPO)", (1, 2), (0.0, 0.25))],
        "length": [("grpo-1 (GRPO)", (1, 2), (0.7, 0.8))],
        "adv/format/share": [("gdpo-1 (GDPO)", (1, 2), (0.9, 0.5))],
    }
    # a run keeps its colour (its position) in every panel
    assert {line.label: line.run for p in panels for line in p.lines} == {
        "gdpo-1 (GDPO)": 0, "grpo-1 (GRPO)": 1, "older": 2}


def test_metrics_of_some_steps_and_nan(tmp_path):
    run = fake_run(tmp_path, "r", [
        {"step": 1, "rewards/a/mean": float("nan")},
        {"step": 2, "rewards/a/mean": 1.0, "eval/task/accuracy": 0.5},
    ])
    (panel, evals) = curves([run], ["eval/task/accuracy"])
    assert panel.lines[0].steps == (1, 2) and math.isnan(panel.lines[0].values[0])
    assert evals.lines[0].steps == (2,) and evals.lines[0].values == (0.5,)


def test_runs_of_one_name_are_told_apart_by_path(tmp_path):
    a = fake_run(tmp_path / "x", "demo", [{"step": 1, "rewards/a/mean": 1.0}], estimator="grpo_no_std")
    b = fake_run(tmp_path / "y", "demo", [{"step": 1, "rewards/a/mean": 0.0}])
    (panel,) = curves([a, b])
    assert [line.label for line in panel.lines] == [f"{a} (GRPO_NO_STD)", str(b)]


def test_the_command_writes_plot_png_here_and_prints_it(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the folder it runs in on it
    assert main(["plot", *map(str, runs[:2]), "--metric", "adv/format/share"]) == 0
    assert (tmp_path / "plot.png").is_file()
    assert capsys.readouterr().out.strip() == "plot written to plot.png"


def test_a_directory_that_is_not_a_run_is_named(runs, tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    assert main(["plot", str(runs[0]), str(tmp_path / "notes"), "--out", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'notes'} is not a run directory (no metrics.jsonl in it)" in err
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_a_metric_no_run_has_gets_near_names(runs, capsys):
    assert main(["plot", *map(str, runs), "--metric", "adv/fromat/share"]) == 2
    err = capsys.readouterr().err
    assert "--metric 'adv/fromat/share': no run logged it; did you mean 'adv/format/share'?" in err
    with pytest.raises(ValueError, match=r"no run logged it \(their keys: adv/, rewards/;"):
        curves(runs, ["zzz"])


def test_the_label_reads_the_config_yaml_a_run_writes(tmp_path):
    import yaml

    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset, resolved_sections

    run = fake_run(tmp_path, "demo-2", [{"step": 1, "rewards/format/mean": 0.5}])
    config = apply_sections(GDPOConfig(), load_preset("demo", ["training.estimator=grpo_no_std"]))
    # as TrainingRun writes it
    (run / "config.yaml").write_text(yaml.safe_dump(resolved_sections(config, {}), sort_keys=False))
    (panel,) = curves([run])
    assert [line.label for line in panel.lines] == ["demo-2 (GRPO_NO_STD)"]
