"""numpy's dtype for each of torch's dtype names that crosses the wire or goes into a dump.

numpy has no bfloat16 or float8: those are ``ml_dtypes``' types, and ``import ml_dtypes`` takes
0.6 s on the project's 2-core VM (ml_dtypes 0.7), more than the rest of the UI's start. It is
imported the first time one of its dtypes is asked for, so a UI, a replay or a training that
never meets a bfloat16 or float8 tensor never pays for it.

>>> numpy_dtype("float32"), numpy_dtype("bfloat16")
(dtype('float32'), dtype(bfloat16))
"""

from __future__ import annotations

import functools

import numpy as np

EXTENDED = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
"""The dtypes numpy does not have, read as ``ml_dtypes``' types."""


@functools.cache
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of torch's dtype ``name`` (``float32``, ``bool``, ``bfloat16``...);
    TypeError for a name numpy and ml_dtypes do not know."""
    if name in EXTENDED:
        import ml_dtypes  # here, not at the top: see the module's docstring

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)
