"""Log lines that say nothing to a gdpo-ray user, dropped where they are emitted: each filter
names its logger and the start of its message, with why it is dropped (``install`` is idempotent;
``GDPOConfig`` installs them in the driver; actors run with ``PYTHONWARNINGS=ignore``)."""

from __future__ import annotations

import logging

#: (logger, message start, why it says nothing here)
FILTERS = (
    ("ray.rllib.algorithms.algorithm_config", "You are running GDPO on the new API stack",
     "GDPO exists only on RLlib's new API stack: the advice to turn it off would break the run"),
)


class _Drop(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def install() -> None:
    for name, start, _ in FILTERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.start == start for f in logger.filters):
            logger.addFilter(_Drop(start))
