"""gdpo-ray checkpoints on disk: what makes one complete and intact, where a run's latest one is,
and what a resumed run may change.

``save_atomically`` (``GDPO.save_to_path``) writes a checkpoint aside, then ``MANIFEST`` (every
file's size and sha256), then ``COMPLETE_MARKER``, then renames it into place; only a directory
holding the marker is a checkpoint (``check_checkpoint``), and ``verify_checkpoint`` (run by
``gdpo-ray train --resume`` before any actor starts) refuses one whose files differ from its
manifest, or that holds a file the manifest does not list. ``MODEL_RECORD`` (the model's
parameter names and shapes) lets ``check_model`` refuse a resume on another model before Ray.
``latest_checkpoint`` finds the one a run resumes from; ``resume_changes`` compares a new run's
config with the checkpoint's, before anything starts; ``set_aside_newer`` keeps a restored run's
timeline (another timeline's newer checkpoints moved out of its way); ``prune_checkpoints`` applies
``training.keep_checkpoints``. ``WriteFailed``: a run's file (a checkpoint, its metrics, ...)
could not be written.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import shutil
import struct
import time
import uuid
from typing import Any, Callable

from gdpo_ray import config as fields
from gdpo_ray.lora import describe, flow, is_adapter_tensor, lora_settings

#: written last into a checkpoint: only a directory holding it is a complete checkpoint
COMPLETE_MARKER = "gdpo_checkpoint_complete"
#: written before the marker: {"files": {relative path: {"size": bytes, "sha256": hex}}}, every
#: file of the checkpoint (RLlib's state and constructor pickles, the learners' files)
MANIFEST = "gdpo_manifest.json"
#: {"model_path": as configured, "parameters": {name: shape} from the model's safetensors headers,
#: or null}: the model the checkpoint's weights (or its LoRA adapter's base) belong to
MODEL_RECORD = "gdpo_model.json"
#: the files every restore reads (besides the learners' own, under ``learner/``)
RESTORE_READS = ("class_and_ctor_args.pkl", "algorithm_state.pkl", "learner/latest")
#: the setting that lets a checkpoint without ``MANIFEST`` be resumed (its files checked for presence)
WITHOUT_MANIFEST = "training.resume_without_manifest"


class WriteFailed(Exception):
    """A run's file could not be written: ``what`` (metrics, checkpoint, policy, ...), ``path``
    and the OS's reason (``OSError``, also one raised on an actor)."""

    def __init__(self, what: str, path: str | pathlib.Path, err: BaseException | str) -> None:
        super().__init__(what, str(path), err if isinstance(err, str) else os_reason(err))
        self.what, self.path, self.reason = self.args

    def __str__(self) -> str:
        return f"cannot write the {self.what} {self.path}: {self.reason}"


def os_reason(err: BaseException) -> str:
    """``[Errno 28] No space left on device`` of an OSError, or of one an actor raised (it
    arrives as a RayTaskError whose ``cause`` is the OSError)."""
    cause = getattr(err, "cause", None) or err
    if isinstance(cause, OSError) and cause.strerror:
        return f"[Errno {cause.errno}] {cause.strerror}"
    return (str(cause).strip().splitlines() or [type(cause).__name__])[-1]


def save_atomically(path: str | pathlib.Path, write: Callable[[pathlib.Path], None], note: str) -> str:
    """A checkpoint at ``path``, atomically: ``write(aside)`` fills a directory beside it, then
    ``MANIFEST`` records every file's size and digest, then ``COMPLETE_MARKER`` (holding
    ``note``) marks it complete, then it is renamed to ``path`` (an older checkpoint there is
    replaced only then). A save cut short leaves a ``.partial-*`` directory, which nothing counts
    or resumes from; one that fails to write (a full disk, a quota) is removed, its space freed,
    and raises ``WriteFailed`` naming ``path`` (the older checkpoint there stays)."""
    final = pathlib.Path(path).resolve()
    aside = final.with_name(f"{final.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        write(aside)
        files = {p.relative_to(aside).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(aside.rglob("*")) if p.is_file()}
        (aside / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
        (aside / COMPLETE_MARKER).write_text(f"{note}\n")
    except OSError as err:  # a learner's OSError arrives as a RayTaskError that is one too
        shutil.rmtree(aside, ignore_errors=True)
        raise WriteFailed("checkpoint", final, err) from None
    if final.exists() and any(final.iterdir()):
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
        aside.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if final.exists():
            final.rmdir()
        aside.rename(final)
    return str(final)


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_checkpoint(checkpoint: str, what: str = "--resume") -> None:
    """Raises ValueError unless ``checkpoint`` is a complete gdpo-ray checkpoint (its marker;
    ``verify_checkpoint`` also reads every file); ``what`` starts the message."""
    root = pathlib.Path(checkpoint)
    if not (root / "class_and_ctor_args.pkl").is_file():
        raise ValueError(f"{what} {checkpoint}: not a gdpo-ray checkpoint (no class_and_ctor_args.pkl)")
    if not (root / COMPLETE_MARKER).is_file():
        siblings = sorted(p.name for p in root.parent.iterdir() if (p / COMPLETE_MARKER).is_file())
        raise ValueError(f"{what} {checkpoint}: an incomplete checkpoint (its save was cut short: "
                         f"no {COMPLETE_MARKER}); resume from a complete one"
                         + (f" beside it: {siblings}" if siblings else ""))


def verify_checkpoint(checkpoint: str, what: str = "--resume", without_manifest: bool = False) -> list[str]:
    """Every file a restore reads, checked before anything starts: the marker, then each file of
    ``MANIFEST`` present, readable, of its recorded size and sha256, and no file the manifest does
    not list (one added, or whose entry was removed, since the save: a restore would read it
    unchecked). Raises ValueError naming every file that is missing, truncated, changed or
    unlisted. A checkpoint without a manifest (written before manifests existed, or its manifest
    removed) is refused unless ``without_manifest`` (``training.resume_without_manifest``): then
    the files a restore reads are checked for presence only, and a warning is returned."""
    root = pathlib.Path(checkpoint)
    if not ((root / COMPLETE_MARKER).is_file() and (root / MANIFEST).is_file()):
        check_checkpoint(checkpoint, what)  # not a checkpoint, an incomplete one, or one without a manifest
    fix = "resume from another checkpoint of the run, or start a new run"
    if not (root / MANIFEST).is_file():
        if not without_manifest:
            raise ValueError(f"{what} {checkpoint}: the checkpoint has no {MANIFEST} (written by a gdpo-ray "
                             f"older than manifests, or removed since the save), so its files cannot be "
                             f"verified against what was saved; set {WITHOUT_MANIFEST}=true to resume it "
                             f"with its files checked for presence only, or {fix}")
        return _present_only(root, checkpoint, what, fix)
    try:
        files = json.loads((root / MANIFEST).read_text())["files"]
        if not all(isinstance(w, dict) and {"size", "sha256"} <= w.keys() for w in files.values()):
            raise ValueError("an entry lacks its size or sha256")
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as err:
        raise ValueError(f"{what} {checkpoint}: its {MANIFEST} is unreadable ({err}); {fix}") from None
    wrong = []
    for name, want in files.items():
        path = root / name
        try:
            size = path.stat().st_size
            if size != want["size"]:
                wrong.append(f"{name} ({size} bytes, {want['size']} when saved)")
            elif _sha256(path) != want["sha256"]:
                wrong.append(f"{name} (its contents changed since the save: sha256 differs)")
        except FileNotFoundError:
            wrong.append(f"{name} (missing)")
        except OSError as err:
            wrong.append(f"{name} (unreadable: {err.strerror or err})")
    present = _restore_files(root)
    wrong += [f"{name} (not in the manifest: added, or its entry removed, since the save)"
              for name in present if name not in files]
    wrong += [f"{name} (missing, and not in the manifest)" for name in _required(root)
              if name not in files and name not in present]
    if wrong:
        shown = "; ".join(wrong[:5]) + (f"; and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        raise ValueError(f"{what} {checkpoint}: the checkpoint is damaged, {len(wrong)} of its "
                         f"{len(set(files) | set(present))} files differ from its {MANIFEST}: {shown}; {fix}")
    return []


def _restore_files(root: pathlib.Path) -> list[str]:
    """The files of a checkpoint a restore may read: all but the marker, the manifest and the
    hidden files at its top (Ray Train's ``.metadata.json``, which no restore reads)."""
    return [name for p in sorted(root.rglob("*")) if p.is_file()
            and (name := p.relative_to(root).as_posix()) not in (MANIFEST, COMPLETE_MARKER)
            and not name.startswith(".")]


def _required(root: pathlib.Path) -> list[str]:
    """``RESTORE_READS``, the driver's state in the format it was saved in (pkl or msgpack)."""
    state = "algorithm_state.msgpack" if (root / "algorithm_state.msgpack").is_file() else "algorithm_state.pkl"
    return [state if name == "algorithm_state.pkl" else name for name in RESTORE_READS]


def _present_only(root: pathlib.Path, checkpoint: str, what: str, fix: str) -> list[str]:
    """A checkpoint without a manifest, resumed with ``training.resume_without_manifest``: the
    files a restore reads present and not empty (ValueError naming those that are not), and the
    warning that their contents are not verified."""
    learner = root / "learner"
    tag = (learner / "latest").read_text().strip() if (learner / "latest").is_file() else ""
    missing = [n for n in _required(root) if not (root / n).is_file() or (root / n).stat().st_size == 0]
    if tag and not any(p.is_file() and p.stat().st_size for p in (learner / tag).glob("*")):
        missing.append(f"learner/{tag}/*")
    if missing:
        raise ValueError(f"{what} {checkpoint}: the checkpoint is damaged: missing or empty: "
                         f"{', '.join(missing)}; {fix}")
    return [f"checkpoint {checkpoint} has no {MANIFEST} ({WITHOUT_MANIFEST}=true): its files are "
            f"there, but their contents are not verified against what was saved"]


def checkpoint_version(checkpoint: str | pathlib.Path) -> int | None:
    """The policy version a complete checkpoint holds (from its marker's note), else None."""
    try:
        found = re.search(r"policy_version (\d+)", (pathlib.Path(checkpoint) / COMPLETE_MARKER).read_text())
    except OSError:
        return None
    return int(found.group(1)) if found else None


def latest_checkpoint(*folders: str | pathlib.Path | None) -> str | None:
    """The complete checkpoint with the highest policy version among those directly in
    ``folders`` (the latest written among equals), or None."""
    found = []
    for folder in folders:
        root = pathlib.Path(folder) if folder else None
        if root is not None and root.is_dir():
            found += [(v, p.stat().st_mtime, str(p)) for p in root.iterdir()
                      if p.is_dir() and (v := checkpoint_version(p)) is not None]
    return max(found)[2] if found else None


def prune_checkpoints(root: str | pathlib.Path, keep: int | None, protect: tuple | list = ()) -> list[str]:
    """``training.keep_checkpoints``: the complete ``step_<N>`` checkpoints directly in ``root``
    beyond the newest ``keep`` deleted (others, ``final`` among them, are never touched, nor those
    in ``protect``: the one a learner recovery goes back to); the deleted paths. ``keep`` None:
    none deleted."""
    if keep is None or not pathlib.Path(root).is_dir():
        return []
    kept = {str(pathlib.Path(p).resolve()) for p in protect if p}
    steps = sorted((v, str(p)) for p in pathlib.Path(root).iterdir()
                   if p.is_dir() and p.name.startswith("step_") and (v := checkpoint_version(p)) is not None)
    gone = [path for _, path in steps[:max(len(steps) - keep, 0)] if str(pathlib.Path(path).resolve()) not in kept]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def set_aside_newer(root: str | pathlib.Path, version: int) -> tuple[pathlib.Path, list[str]] | None:
    """A restore of ``version`` into a run whose checkpoints folder ``root`` holds newer complete
    checkpoints (``step_<N>``, ``final``: a later point of the timeline the restore leaves): they
    are moved into ``root/abandoned-after-step_<version>-<time>``, so that the restored run's own
    checkpoints are not outranked (``training.keep_checkpoints`` would delete them as they are
    written, ``--resume RUN_DIR`` would pick the abandoned one). That folder and the names moved,
    or None when there were none. Nothing is deleted."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return None
    newer = sorted((p for p in root.iterdir() if p.is_dir() and (checkpoint_version(p) or -1) > version),
                   key=lambda p: (checkpoint_version(p), p.name))
    if not newer:
        return None
    aside = root / f"abandoned-after-step_{version:06d}-{time.strftime('%Y%m%d-%H%M%S')}"
    while aside.exists():
        aside = aside.with_name(f"{aside.name}-{uuid.uuid4().hex[:4]}")
    aside.mkdir()
    for path in newer:
        path.rename(aside / path.name)
    return aside, [p.name for p in newer]


def write_model_record(folder: str | pathlib.Path, model_path: str, model_dir: str | pathlib.Path) -> None:
    """``MODEL_RECORD`` into a checkpoint being written: the configured ``llm.model_path`` and its
    directory's parameter names and shapes (``model_parameters``)."""
    record = {"model_path": str(model_path), "parameters": model_parameters(model_dir)}
    (pathlib.Path(folder) / MODEL_RECORD).write_text(json.dumps(record))


def model_parameters(model_dir: str | pathlib.Path) -> dict[str, list[int]] | None:
    """Every tensor's name and shape in a model directory, as its safetensors files declare them
    in their JSON headers (the first 8 + N bytes of each: no weight is read, no torch imported);
    None for a directory without safetensors files (weights as ``.bin``) or that cannot be read."""
    root = pathlib.Path(model_dir)
    try:
        index = root / "model.safetensors.index.json"
        shards = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                  else [p.name for p in sorted(root.glob("*.safetensors"))])
        shapes: dict[str, list[int]] = {}
        for shard in shards:
            with open(root / shard, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            shapes |= {name: list(t["shape"]) for name, t in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return shapes or None


def check_model(config: Any, checkpoint: str, what: str = "--resume") -> list[str]:
    """The configured model (``llm.model_path``) against the one the checkpoint was trained on,
    before anything starts: their parameter names and shapes (``MODEL_RECORD``, or, for a
    checkpoint written before it, the saved model's directory where it is still here). Raises
    ValueError naming both models, the first parameter that differs and the fix; under LoRA the
    checkpoint's adapter was made for its base model's layers (its target modules and rank are
    ``resume_changes``'). A comparison that cannot be made (no safetensors headers) while the
    model path changed: returned as a warning."""
    from gdpo_ray.model_files import resolve_model_path

    root = pathlib.Path(checkpoint)
    try:
        record = json.loads((root / MODEL_RECORD).read_text())
    except (OSError, ValueError):
        record = None
    saved = saved_config(checkpoint)
    before, now = str((record or saved).get("model_path")), str(config.model_path)
    if record is not None:
        old = record.get("parameters")
    elif before == now:
        return []  # an older checkpoint, the same model path: nothing else to compare it with
    else:
        try:
            old = model_parameters(resolve_model_path(before))
        except (ValueError, OSError):  # a hub model no longer cached, a folder gone
            old = None
    new = model_parameters(resolve_model_path(now))
    if old is None or new is None:
        return [] if before == now else [
            f"{what} {checkpoint}: llm.model_path is {now} and the checkpoint was trained on {before}; "
            f"their parameters could not be compared (no safetensors headers), so a model that does "
            f"not fit the checkpoint fails only when the learners load it"]
    differ = [name for name in [*old, *(n for n in new if n not in old)] if old.get(name) != new.get(name)]
    if not differ:
        return []
    first = differ[0]
    if first not in new:
        said = f"{first} {old[first]} of {before} is not in {now}"
    elif first not in old:
        said = f"{now} has {first} {new[first]}, which {before} has not"
    else:
        said = f"{first} is {old[first]} in {before} and {new[first]} in {now}"
    lora = lora_settings(saved.get("lora"))
    holds = (f"its LoRA adapter {describe(lora)} was trained on the layers of the base model {before}"
             if lora else f"its weights are those of {before}")
    raise ValueError(f"{what} {checkpoint}: llm.model_path {now} does not fit the checkpoint ({holds}): "
                     f"{said} (the first of {len(differ)} parameters that differ); set "
                     f"llm.model_path={before} (the checkpoint's model), or start a new run on {now} "
                     f"without this checkpoint")


def resume_changes(config: Any, checkpoint: str) -> list[tuple[str, Any, Any]]:
    """(field, saved value, this config's value) of every GDPO field that differs from the
    checkpoint's config. Raises ValueError, before anything starts, if a field marked
    ``fixed_on_resume`` (``gdpo_ray.config.RESUME_FIXED``) differs: the saved prompt state
    would then point into other data, or the saved weights be those of another adapter
    (``llm.lora``, compared with PEFT's defaults filled in: ``{r: 8}`` is ``{r: 8, lora_alpha: 8}``)."""
    saved = saved_config(checkpoint)
    names = [*fields.FIELDS, *fields.RLLIB_FIELDS]
    changes = [(name, saved.get(name), getattr(config, name)) for name in names
               if _as_resumed(name, saved.get(name)) != _as_resumed(name, getattr(config, name))]
    for name, old, new in changes:
        if name == "lora":
            raise ValueError(f"--resume {checkpoint}: {_lora_change(old, new)}")
        if name == "backend":
            raise ValueError(f"--resume {checkpoint}: learners.backend was {_as_resumed(name, old)!r} and is "
                             f"{new!r} now; the learners' checkpoint is in its backend's format: set "
                             f"learners.backend={_as_resumed(name, old)} (or start a new run)")
        if name in fields.RESUME_FIXED:
            section = (fields.FIELDS | fields.RLLIB_FIELDS)[name].section
            raise ValueError(f"--resume {checkpoint}: {section}.{name} was {old!r} "
                             f"and is {new!r} now; a run resumes on the data it started with (set it "
                             f"back, or start a new run)")
    return changes


def _as_resumed(name: str, value: Any) -> Any:
    """A field's value as a resume compares it: ``llm.lora`` normalized, ``learners.backend``
    deepspeed where a checkpoint predates the field, the others as given."""
    if name == "backend":
        return value or "deepspeed"
    if name == "lora":
        try:
            return lora_settings(value)
        except ValueError:  # not a valid setting (this run's is checked before): compared as given
            return value
    return value


def _lora_change(old: Any, new: Any) -> str:
    """What differs between the checkpoint's ``llm.lora`` and this run's, and the fix."""
    before, after = _as_resumed("lora", old), _as_resumed("lora", new)
    said = (f"llm.lora: the checkpoint was trained with {describe(before)}, this run asks for "
            f"{describe(after)}")
    if before and after:
        differ = [f"{k} {flow(before[k])} -> {flow(after[k])}" for k in before if before[k] != after[k]]
        said += f" ({', '.join(differ)})"
    return (f"{said}; a run resumes the weights it saved, which are those of the checkpoint's "
            f"adapter: set llm.lora back to {describe(before) if before else 'null'}, or start a "
            f"new run")


def saved_config(checkpoint: str) -> dict:
    """The GDPO fields a checkpoint was written with."""
    import pickle

    check_checkpoint(checkpoint)
    try:
        with open(pathlib.Path(checkpoint) / "class_and_ctor_args.pkl", "rb") as f:
            return pickle.load(f)["ctor_args_and_kwargs"][0][0]
    except Exception as err:  # noqa: BLE001 - whatever a damaged pickle raises
        raise ValueError(f"--resume {checkpoint}: its class_and_ctor_args.pkl cannot be read "
                         f"({type(err).__name__}: {err}); resume from another checkpoint") from None


def export_checkpoint_policy(checkpoint: str, out: str) -> str:
    """A checkpoint's policy as a Hugging Face model directory ``out``: the learners' saved
    weights, full and in float32 (read by the run's backend, ``learners.backend``: DeepSpeed's
    ``zero_to_fp32`` for any ZeRO stage, FSDP2's distributed checkpoint), in the run's base model
    (its config, tokenizer and dtype: bf16 stays bf16); under ``llm.lora`` the adapter merged into it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gdpo_ray.model_files import resolve_model_path
    from learners.backend import learner_class

    saved = saved_config(checkpoint)
    base, lora = resolve_model_path(saved["model_path"]), lora_settings(saved.get("lora"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if lora:  # the checkpoint holds the adapter alone (the base weights are the model's files)
        from peft import get_peft_model

        from gdpo_ray.lora import peft_config

        model = get_peft_model(model, peft_config(lora))
    backend = learner_class(_as_resumed("backend", saved.get("backend")))
    weights = backend.checkpoint_weights(str(pathlib.Path(checkpoint) / "learner"), model, bool(lora))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if lora:
        missing = [k for k in missing if is_adapter_tensor(k)]
    missing = sorted(set(missing) - set(getattr(model, "_tied_weights_keys", None) or ()))
    if missing or unexpected:
        raise ValueError(f"checkpoint {checkpoint}: its weights do not fit the base model {base} "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    from gdpo_ray.model_files import saved_dtype

    (model.merge_and_unload() if lora else model).to(getattr(torch, saved_dtype(base))).save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out
