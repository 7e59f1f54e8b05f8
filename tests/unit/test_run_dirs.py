"""Run directories and checkpoints on disk, through `gdpo-ray train` where a user meets them, all
before Ray starts (issue 29): a run directory is taken atomically (two runs of one name cannot
share it, even when both passed the start-up check), `--resume` refuses a damaged checkpoint
naming what is wrong (every file against the manifest written at save time, and no file it does
not list; one without a manifest only with training.resume_without_manifest), a checkpoint of
another model (issue 50), and a full disk is a message naming the file, not a traceback."""

import errno
import json
import multiprocessing
import os
import pickle
from pathlib import Path

import pytest

from gdpo_ray.run.checkpoints import (MANIFEST, WriteFailed, checkpoint_version, latest_checkpoint,
                                      prune_checkpoints, save_atomically, set_aside_newer, verify_checkpoint,
                                      write_model_record)
from gdpo_ray.run.cli import main
from gdpo_ray.run.loggers import RunLog
from gdpo_ray.run.outputs import RUN_LOCK, OutputDir
from gdpo_ray.run.train import TrainingRun

COMMON = ["training.prompts_per_step=4", "training.group_size=4", "generation.max_tokens=32"]


@pytest.fixture
def no_ray(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TrainingRun, "_start_ray", lambda self: pytest.fail("Ray was started"))


def fake_checkpoint(run_dir: Path, version: int, name: str | None = None, overrides=()) -> Path:
    """A checkpoint laid out as GDPO.save_to_path writes one (RLlib's files, the learner's
    DeepSpeed files, the model's parameter names and shapes), of the demo preset's config (with
    ``overrides``), saved by ``save_atomically``."""
    from gdpo_ray import GDPOConfig
    from gdpo_ray.model_files import resolve_model_path
    from gdpo_ray.run.presets import apply_sections, load_preset

    config = apply_sections(GDPOConfig(), load_preset("demo", [*COMMON, *overrides]))
    config.checkpoint_dir = str(run_dir / "checkpoints")

    def write(aside: Path) -> None:
        (aside / "learner" / f"step{version}").mkdir(parents=True)
        with open(aside / "class_and_ctor_args.pkl", "wb") as f:
            pickle.dump({"class": None, "ctor_args_and_kwargs": ((config.get_state(),), {})}, f)
        (aside / "algorithm_state.pkl").write_bytes(pickle.dumps({"policy_version": version}))
        (aside / "rllib_checkpoint.json").write_text("{}")
        (aside / "learner" / "latest").write_text(f"step{version}")
        (aside / "learner" / f"step{version}" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(4096))
        (aside / "learner" / f"step{version}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(os.urandom(8192))
        write_model_record(aside, config.model_path, resolve_model_path(config.model_path))

    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_LOCK).touch()
    path = run_dir / "checkpoints" / (name or f"step_{version:06d}")
    return Path(save_atomically(path, write, f"policy_version {version}"))


def take(base: str, name: str | None, barrier, results) -> None:
    """One of several runs starting at once: each passes the start-up check (the name is free),
    then they take their directories at the same moment."""
    try:
        out = OutputDir(base, name, "demo")
        barrier.wait()
        out.create()
        (out.local / "metrics.jsonl").write_text(f"{os.getpid()}\n")
        results.put("took")
    except ValueError as err:
        results.put(str(err))


def race(base: Path, name: str | None, runs: int = 6) -> list[str]:
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(runs), ctx.Queue()
    procs = [ctx.Process(target=take, args=(str(base), name, barrier, results)) for _ in range(runs)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    return outcomes


def test_racing_runs_never_share_a_directory(tmp_path):
    # six runs of one name: exactly one gets the directory, the others are refused; six unnamed
    # runs in the same second get six directories
    named = race(tmp_path, "same")
    assert named.count("took") == 1, named
    assert all("taken by another run that started meanwhile" in r for r in named if r != "took")
    assert race(tmp_path / "unnamed", None) == ["took"] * 6
    assert len(list((tmp_path / "unnamed").iterdir())) == 6


def test_a_name_taken_while_the_run_checked_is_refused_before_ray(no_ray, tmp_path, capsys, monkeypatch):
    # both runs pass the start-up check (the name was free), then the other takes the directory
    # first: this one is refused before Ray, and the other's files stay untouched
    check = TrainingRun.check
    rival = OutputDir(str(tmp_path / "runs"), "same", "demo")

    def check_while_another_starts(self, *args, **kwargs):
        report = check(self, *args, **kwargs)
        rival.create()
        (rival.local / "metrics.jsonl").write_text('{"step": 1}\n')
        return report

    monkeypatch.setattr(TrainingRun, "check", check_while_another_starts)
    assert main(["train", "demo", "run.name=same", "run.output_dir=runs", *COMMON]) == 2
    assert "was taken by another run that started meanwhile (run.name='same')" in capsys.readouterr().err
    assert (rival.local / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_resume_continues_in_the_run_directory_unless_renamed_or_in_use(no_ray, tmp_path, capsys):
    run = tmp_path / "runs" / "first"
    fake_checkpoint(run, 2)
    latest = fake_checkpoint(run, 3, "final")
    # the run directory: its latest checkpoint, the same directory (named or not)
    for extra in ([], ["run.name=first", "run.output_dir=runs"]):
        resumed = TrainingRun.from_args("demo", [*COMMON, *extra], resume="runs/first")
        assert resumed.resume == str(latest) and resumed.run_dir == run and resumed.outputs.continuing
    # a checkpoint in it with a new name: a new run from that state
    renamed = TrainingRun.from_args("demo", [*COMMON, "run.name=second", "run.output_dir=runs"],
                                    resume="runs/first/checkpoints/step_000002")
    assert renamed.run_dir == tmp_path / "runs" / "second" and not renamed.outputs.continuing
    # an older checkpoint in a run that went on past it: two histories in one directory, refused
    assert main(["train", "demo", *COMMON, "--resume", "runs/first/checkpoints/step_000002"]) == 2
    assert f"went on past this checkpoint (to {latest})" in capsys.readouterr().err
    # a run still running holds its directory: a second process cannot continue it meanwhile
    holder = OutputDir("runs", None, "demo", continuing=run)
    holder.create()
    try:
        assert main(["train", "demo", *COMMON, "--resume", "runs/first"]) == 2
        assert f"run directory {run} is in use by a running gdpo-ray train (pid {os.getpid()}" in \
            capsys.readouterr().err
    finally:
        holder.release()
    # a run directory with no checkpoint: nothing to resume, said so
    (tmp_path / "runs" / "empty" / "checkpoints").mkdir(parents=True)
    assert main(["train", "demo", *COMMON, "--resume", "runs/empty"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage(path: Path) -> None:
    path.write_bytes(b"\x80garbage" + b"\0" * (path.stat().st_size - 8))  # the same size


# the six damaged checkpoints of issue 29 item 8, and what the refusal names
DAMAGE = {
    "truncated model": (lambda c: truncate(next(c.glob("learner/step*/mp_rank_00_model_states.pt"))),
                        "learner/step3/mp_rank_00_model_states.pt (2048 bytes, 4096 when saved)"),
    "truncated optimizer": (lambda c: truncate(next(c.glob("learner/step*/*optim_states.pt"))),
                            "zero_pp_rank_0_mp_rank_00_optim_states.pt (4096 bytes, 8192 when saved)"),
    "truncated algorithm state": (lambda c: truncate(c / "algorithm_state.pkl"), "algorithm_state.pkl ("),
    "empty learner directory": (lambda c: [p.unlink() for p in c.glob("learner/**/*") if p.is_file()],
                                "3 of its 7 files differ from its gdpo_manifest.json: learner/latest (missing)"),
    "deleted learner directory": (lambda c: __import__("shutil").rmtree(c / "learner"),
                                  "3 of its 7 files differ from its gdpo_manifest.json: learner/latest (missing)"),
    "garbage constructor args": (lambda c: garbage(c / "class_and_ctor_args.pkl"),
                                 "class_and_ctor_args.pkl (its contents changed since the save"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_refused_before_ray(no_ray, tmp_path, capsys, damage):
    checkpoint = fake_checkpoint(tmp_path / "runs" / "old", 3)
    assert verify_checkpoint(str(checkpoint)) == []  # intact: every file as saved
    harm, named = DAMAGE[damage]
    harm(checkpoint)
    assert main(["train", "demo", *COMMON, "--resume", str(checkpoint), "run.name=new"]) == 2
    err = capsys.readouterr().err
    assert f"--resume {checkpoint}: the checkpoint is damaged" in err and named in err, err
    assert "Traceback" not in err and not (tmp_path / "runs" / "new").exists()


def test_the_manifest_lists_every_file_and_older_checkpoints_are_checked_for_presence(tmp_path):
    checkpoint = fake_checkpoint(tmp_path / "run", 1)
    files = json.loads((checkpoint / MANIFEST).read_text())["files"]
    assert sorted(files) == ["algorithm_state.pkl", "class_and_ctor_args.pkl", "gdpo_model.json",
                             "learner/latest", "learner/step1/mp_rank_00_model_states.pt",
                             "learner/step1/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                             "rllib_checkpoint.json"]
    assert files["learner/latest"]["size"] == 5  # "step1"
    assert latest_checkpoint(tmp_path / "run" / "checkpoints") == str(checkpoint)
    # written by an older gdpo-ray (no manifest): refused, unless asked for; then its files are
    # checked for presence, with a warning
    (checkpoint / MANIFEST).unlink()
    with pytest.raises(ValueError, match="has no gdpo_manifest.json .* set training.resume_without_manifest=true"):
        verify_checkpoint(str(checkpoint))
    assert "not verified" in verify_checkpoint(str(checkpoint), without_manifest=True)[0]
    (checkpoint / "learner" / "latest").unlink()
    with pytest.raises(ValueError, match="missing or empty: learner/latest"):
        verify_checkpoint(str(checkpoint), without_manifest=True)


def test_a_full_disk_names_the_file_and_frees_a_partial_checkpoint(tmp_path):
    # /dev/full answers every write with ENOSPC, as a full disk does
    full = Path("/dev/full")
    if not full.exists():
        pytest.skip("no /dev/full")
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    (log_dir / "metrics.jsonl").symlink_to(full)
    log = RunLog(log_dir)
    with pytest.raises(WriteFailed) as caught:
        log.log(1, {"rewards/a/mean": 0.5})
    log.close()  # no second error
    assert str(caught.value) == f"cannot write the metrics {log_dir / 'metrics.jsonl'}: [Errno 28] No space left on device"
    # a checkpoint whose files cannot be written: refused with its path, the partial save removed,
    # the older checkpoint at that path kept
    old = fake_checkpoint(tmp_path / "run", 1, "final")

    def write(aside: Path) -> None:
        aside.mkdir()
        (aside / "algorithm_state.pkl").write_bytes(b"x" * 100)
        with open(full, "wb") as f:
            f.write(b"x" * 100)
            f.flush()

    with pytest.raises(WriteFailed, match=rf"cannot write the checkpoint {old}: \[Errno {errno.ENOSPC}\]"):
        save_atomically(old, write, "policy_version 2")
    assert sorted(p.name for p in old.parent.iterdir()) == ["final"]
    assert verify_checkpoint(str(old)) == []


@pytest.mark.parametrize("damage", ["truncated model", "deleted learner directory"])
def test_the_python_api_verifies_a_checkpoint_before_any_actor_starts(tmp_path, monkeypatch, damage):
    """``GDPO.from_checkpoint`` (and Tune's restore, ``restore_from_path``) refuse a damaged
    checkpoint as ``--resume`` does, before the algorithm (and its actors) is built."""
    from gdpo_ray.run.algorithm import GDPO

    monkeypatch.setattr(GDPO, "setup", lambda self, config: pytest.fail("actors were started"))
    checkpoint = fake_checkpoint(tmp_path / "runs" / "old", 3)
    harm, named = DAMAGE[damage]
    harm(checkpoint)
    with pytest.raises(ValueError, match="restoring .*: the checkpoint is damaged") as err:
        GDPO.from_checkpoint(str(checkpoint))
    assert named in str(err.value)
    algo = object.__new__(GDPO)  # restore_from_path reads nothing of a damaged checkpoint
    with pytest.raises(ValueError, match="the checkpoint is damaged"):
        algo.restore_from_path(str(checkpoint))


def drop_entry(checkpoint: Path, name: str) -> None:
    """``name``'s entry removed from the checkpoint's manifest (the file stays)."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    del manifest["files"][name]
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


# files a restore would read that the manifest does not vouch for (issue 50), and what the refusal names
UNLISTED = {
    "entry removed, then the file changed": (
        lambda c: (drop_entry(c, "algorithm_state.pkl"), garbage(c / "algorithm_state.pkl")),
        "algorithm_state.pkl (not in the manifest: added, or its entry removed, since the save)"),
    "a file added beside the learner's": (
        lambda c: (c / "learner" / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x" * 64),
        "learner/step3/zero_pp_rank_1_mp_rank_00_optim_states.pt (not in the manifest"),
    "entry and file removed": (
        lambda c: (drop_entry(c, "learner/latest"), (c / "learner" / "latest").unlink()),
        "learner/latest (missing, and not in the manifest)"),
}


@pytest.mark.parametrize("change", UNLISTED)
def test_every_file_a_restore_reads_must_be_in_the_manifest(no_ray, tmp_path, capsys, change):
    checkpoint = fake_checkpoint(tmp_path / "runs" / "old", 3)
    harm, named = UNLISTED[change]
    harm(checkpoint)
    assert main(["train", "demo", *COMMON, "--resume", str(checkpoint), "run.name=new"]) == 2
    err = capsys.readouterr().err
    assert f"--resume {checkpoint}: the checkpoint is damaged" in err and named in err, err
    assert "Traceback" not in err and not (tmp_path / "runs" / "new").exists()


def test_a_checkpoint_without_a_manifest_needs_the_setting_that_accepts_it(no_ray, tmp_path, capsys):
    checkpoint = fake_checkpoint(tmp_path / "runs" / "old", 3)
    (checkpoint / MANIFEST).unlink()  # an older gdpo-ray's checkpoint, or its manifest removed
    assert main(["train", "demo", *COMMON, "--resume", str(checkpoint), "run.name=new"]) == 2
    err = capsys.readouterr().err
    assert f"--resume {checkpoint}: the checkpoint has no gdpo_manifest.json" in err, err
    assert "set training.resume_without_manifest=true to resume it with its files checked for presence only" in err
    assert not (tmp_path / "runs" / "new").exists()
    # asked for: resumed, its files checked for presence, with the warning the run prints
    run = TrainingRun.from_args("demo", [*COMMON, "run.name=new", "training.resume_without_manifest=true"],
                                resume=str(checkpoint))
    assert run.resume == str(checkpoint)
    assert run.warnings == [f"checkpoint {checkpoint} has no gdpo_manifest.json (training.resume_without_manifest"
                            f"=true): its files are there, but their contents are not verified against what was saved"]


@pytest.mark.parametrize("lora", [None, "llm.lora={r: 8}"])
def test_a_resume_on_another_model_is_refused_before_ray(no_ray, tmp_path, capsys, tiny_model_dir, lora):
    """The demo model's checkpoint (its weights, or a LoRA adapter for its layers) resumed with
    llm.model_path naming another model (hidden size 64, the demo's 128): refused before Ray,
    naming both models, the first parameter that differs and the fix."""
    same = [lora] if lora else []
    checkpoint = fake_checkpoint(tmp_path / "runs" / "old", 3, overrides=same)
    assert main(["train", "demo", *COMMON, *same, f"llm.model_path={tiny_model_dir}",
                 "--resume", str(checkpoint), "run.name=new"]) == 2
    err = capsys.readouterr().err
    assert f"--resume {checkpoint}: llm.model_path {tiny_model_dir} does not fit the checkpoint (" in err, err
    assert (f"): model.embed_tokens.weight is [384, 128] in demo and [384, 64] in {tiny_model_dir} "
            f"(the first of 22 parameters that differ); set llm.model_path=demo (the checkpoint's model), "
            f"or start a new run on {tiny_model_dir} without this checkpoint") in err, err
    holds = ("its LoRA adapter {r: 8, lora_alpha: 8, lora_dropout: 0.0, target_modules: all-linear} was "
             "trained on the layers of the base model demo" if lora else "its weights are those of demo")
    assert holds in err, err
    assert "Traceback" not in err and not (tmp_path / "runs" / "new").exists()
    # the checkpoint's own model: nothing to say
    assert TrainingRun.from_args("demo", [*COMMON, *same, "run.name=new"], resume=str(checkpoint)).warnings == []


def test_the_python_api_refuses_a_restore_on_another_model(tmp_path, monkeypatch, tiny_model_dir):
    """``algo.restore_from_path`` (Tune's restore too) of a checkpoint of another model: refused
    with the same message before the learners would load it (no state-dict traceback)."""
    import re

    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.algorithm import GDPO
    from gdpo_ray.run.presets import apply_sections, load_preset

    checkpoint = fake_checkpoint(tmp_path / "runs" / "old", 3)
    algo = object.__new__(GDPO)
    algo.config = apply_sections(GDPOConfig(), load_preset("demo", [*COMMON, f"llm.model_path={tiny_model_dir}"]))
    with pytest.raises(ValueError, match=re.escape(f"restoring {checkpoint}: llm.model_path {tiny_model_dir} "
                                                   f"does not fit the checkpoint")):
        algo.restore_from_path(str(checkpoint))


def test_pruning_spares_the_recovery_checkpoint_and_a_restore_sets_a_later_timeline_aside(tmp_path):
    """``training.keep_checkpoints`` never deletes the checkpoint a learner recovery goes back
    to, even when checkpoints of later steps (another timeline's) outrank it; and a restore of
    step 2 moves those later ones aside, whole, into one named folder (issue 50)."""
    root = tmp_path / "run" / "checkpoints"
    recovery = fake_checkpoint(tmp_path / "run", 2)
    later = [fake_checkpoint(tmp_path / "run", 5), fake_checkpoint(tmp_path / "run", 5, "final")]
    assert prune_checkpoints(root, 1, protect=[str(recovery)]) == [] and recovery.is_dir()
    folder, names = set_aside_newer(root, 2)
    assert names == ["final", "step_000005"] and folder.parent == root
    assert folder.name.startswith("abandoned-after-step_000002-")
    assert sorted(p.name for p in root.iterdir()) == [folder.name, "step_000002"]
    assert all(verify_checkpoint(str(folder / p.name)) == [] for p in later)  # moved whole
    assert latest_checkpoint(root) == str(recovery) and checkpoint_version(recovery) == 2
    assert set_aside_newer(root, 2) is None  # nothing newer now: nothing moved, nothing said
