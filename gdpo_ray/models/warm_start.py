"""What the demo models' warm starts share: a tiny local model (``gdpo_ray.models.tiny``) fitted
to a deliberately mediocre teacher on its task, cached.

A randomly initialised model never writes ``<answer>7</answer>``, so RL would have no signal. A
warm start fits the tiny model to a teacher whose mistakes are slips the model can represent
per prompt, so that every reward starts well below its maximum and RL has each of them to
improve. A task brings its teacher and its recipe (a dict of the settings, the cache key:
``demo``, ``demo_tools``, ``demo_count``, ``demo_agent``); this module holds what they share:
``cached_model`` (built once per machine under ``$GDPO_RAY_CACHE``, default
``~/.cache/gdpo-ray``, keyed by the name and the recipe, renamed into place atomically) and
``fit_on_prompts``; each is a recipe on the project's one supervised trainer
(``gdpo_ray.sft.supervised_fit``: teacher forcing, the loss on the response tokens only).

A build stopped part-way leaves nothing behind (``build_atomically``): it writes into
``<target>.tmp-<host>-<pid>``, which an exception, Ctrl-C or SIGTERM removes (with one line
saying so: the next use builds it again); where nothing in the process handles SIGTERM (``gdpo-ray
eval demo``, a script), SIGTERM during the build exits with status 143 rather than killing the
process mid-write. A folder left by a build that was killed outright (SIGKILL, out of memory) is
removed by the next build on the same host.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from gdpo_ray.sft import supervised_fit


def cache_root(cache: str | Path | None = None) -> Path:
    """``cache``, else ``$GDPO_RAY_CACHE``, else ``~/.cache/gdpo-ray``."""
    return Path(cache or os.environ.get("GDPO_RAY_CACHE", Path.home() / ".cache" / "gdpo-ray"))


def cached_model(name: str, recipe: dict, build: Callable[[Path, dict], None],
                 cache: str | Path | None = None) -> Path:
    """``<cache>/<name>-<hash of recipe>``, made by ``build(directory, recipe)`` if missing."""
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_root(cache) / f"{name}-{key}"
    return build_atomically(target, lambda tmp: build(tmp, recipe), f"the warm start of {name}",
                            ready=lambda path: (path / "config.json").exists())


def build_atomically(target: Path, build: Callable[[Path], None], what: str,
                     ready: Callable[[Path], bool]) -> Path:
    """``target``, made by ``build(folder)`` into a temporary folder beside it and renamed into
    place (a concurrent reader never sees half a directory) unless ``ready(target)`` already.
    Whatever stops the build (an error, Ctrl-C, SIGTERM) removes that folder; an interruption
    says so in one line on stderr, naming ``what`` was stopped."""
    if ready(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target)
    tmp = target.with_name(f"{target.name}{_TMP}{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _sigterm_stops_the_build():
            build(tmp)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(err, Exception):  # Ctrl-C, SIGTERM: the user asked; say what it left
            print(f"gdpo-ray: {what} was stopped ({_stopped_by(err)}); its partial folder {tmp} was "
                  f"removed: the next use builds it again", file=sys.stderr, flush=True)
        raise
    try:
        tmp.rename(target)  # atomic: a concurrent reader never sees half a directory
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


#: what a build's temporary folder adds to the target's name (then ``<host>-<pid>``)
_TMP = ".tmp-"


def _remove_abandoned(target: Path) -> None:
    """The temporary folders of ``target`` left by builds on this host whose process is gone
    (killed outright: SIGKILL, out of memory); a live build's, or another host's on a shared
    cache, stays."""
    host = socket.gethostname()
    for folder in target.parent.glob(f"{target.name}{_TMP}*"):
        owner, _, pid = folder.name[len(target.name) + len(_TMP):].rpartition("-")
        if owner == host and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class _Terminated(SystemExit):
    """SIGTERM during a build: exits with 128 + 15, as the signal itself would have."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


@contextlib.contextmanager
def _sigterm_stops_the_build() -> Iterator[None]:
    """While a build runs in the main thread of a process that leaves SIGTERM to its default
    action (killed at once, mid-write): SIGTERM raises ``_Terminated`` instead, so the build's
    folder is removed and the process exits 143. A handler of the process's own (``gdpo-ray
    train``'s, Ray's) is left in place: it raises in the build just the same."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise _Terminated(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stopped_by(err: BaseException) -> str:
    """The signal that stopped a build, in words, from the exception it raised."""
    signum = getattr(err, "signum", None)  # ours, and gdpo-ray train's (``train.Interrupted``)
    if isinstance(signum, int):
        return signal.Signals(signum).name
    if isinstance(err, KeyboardInterrupt):
        return "SIGINT"
    code = getattr(err, "code", None)  # Ray's SIGTERM handler: sys.exit(15)
    return type(err).__name__ + (f" {code}" if code is not None else "")


def fit_on_prompts(path: Path, recipe: dict, prompts_of: Callable[[Any], list[list[int]]],
                   batches_of: Callable[[Any, list[list[int]], np.random.Generator], Iterable]) -> None:
    """Fits the untrained model in ``path`` (``supervised_fit``, seeded by ``recipe["seed"]``)
    and saves it. ``prompts_of(tokenizer)``: each row's prompt ids; the prefix they all share (a
    system message, the tools' listing) is cut off and run once per batch, and
    ``batches_of(tokenizer, the prompts past it, rng)`` gives the examples."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = prompts_of(tokenizer)
    shared = next(i for i, ids in enumerate(zip(*prompts)) if len(set(ids)) > 1)
    rng = np.random.default_rng(recipe["seed"])
    torch.manual_seed(recipe["seed"])
    supervised_fit(model, batches_of(tokenizer, [p[shared:] for p in prompts], rng), recipe["lr"],
                   tokenizer.pad_token_id, prefix=prompts[0][:shared])
    model.save_pretrained(path)


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The token ids a rollout actor gives the model for ``messages`` (chat template, generation
    prompt, no extra special tokens)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def response_ids(tokenizer: Any, response: str) -> list[int]:
    """``response``'s token ids and the EOS token that ends it."""
    return tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
