"""BFCL v4's data as the ``bfcl-eval`` package ships it (``pip install --no-deps
bfcl-eval==2026.3.23``: its ``data/BFCL_v4_<category>.json`` and ``data/possible_answer/``, JSON
lines), and the split of its multi-turn scenarios into training and held-out ones, which the
``task:bfcl_multi_turn`` rows and the ``bfcl:multi_turn_*`` suites share.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

VERSION = "BFCL_v4"


def data_dir() -> Path:
    """bfcl-eval's data directory (the package is not imported: its modules need the
    leaderboard's model SDKs)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--suite bfcl needs the data of the bfcl-eval package: "
                         "pip install --no-deps bfcl-eval==2026.3.23")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _lines(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_category(category: str) -> list[dict]:
    """The items of ``category``: the prompt entry (id, question, function) with its
    ``ground_truth`` (None for the relevance categories)."""
    root = data_dir()
    items = _lines(root / f"{VERSION}_{category}.json")
    answers = root / "possible_answer" / f"{VERSION}_{category}.json"
    if answers.is_file():
        by_id = {a["id"]: a["ground_truth"] for a in _lines(answers)}
        for item in items:
            item["ground_truth"] = by_id[item["id"]]
    return items


# --- the multi-turn split -----------------------------------------------------------------------

HELD_OUT_FRACTION = 5
HELD_OUT_RULE = ("scenario n (the number ending the item id) is held out when "
                 "int(sha256(f'bfcl-multi-turn-{n}').hexdigest(), 16) % 5 == 0")


def scenario_of(item_id: str) -> int:
    """The scenario number of an item id (``multi_turn_long_context_17`` -> 17)."""
    return int(item_id.rsplit("_", 1)[1])


def is_held_out(item_id: str) -> bool:
    """Whether the item's scenario is held out from training (``HELD_OUT_RULE``: 41 of the
    200 scenarios, in every category)."""
    digest = hashlib.sha256(f"bfcl-multi-turn-{scenario_of(item_id)}".encode()).hexdigest()
    return int(digest, 16) % HELD_OUT_FRACTION == 0
