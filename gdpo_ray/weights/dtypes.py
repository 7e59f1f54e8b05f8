"""Dtype names as buckets record them (torch's: "float32", "bfloat16"), read without torch: an
engine without torch (``simulated``) unpacks and digests pushes with numpy alone."""

from __future__ import annotations

import numpy as np

#: bytes per element of torch's dtypes that numpy has no name for
TORCH_ONLY = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1}


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype's name."""
    return TORCH_ONLY[dtype] if dtype in TORCH_ONLY else np.dtype(dtype).itemsize


def numpy_dtype(dtype: str, name: str) -> np.dtype:
    """numpy's dtype of tensor ``name`` pushed as ``dtype``; ValueError for one numpy cannot hold."""
    if dtype in TORCH_ONLY:
        raise ValueError(f"{name} was pushed as {dtype}, which numpy does not hold: an engine without torch "
                         "(simulated) takes float32 pushes")
    return np.dtype(dtype)
