"""Shared test setup: one thread per process, local Ray without token authentication."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_configure(config):
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)
