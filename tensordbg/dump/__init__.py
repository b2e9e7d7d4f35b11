"""Dumps: what a watched training writes for a person to open later (``tensordbg.load``,
``tensordbg replay``) or for a script to check (``tensordbg check``).

Writing: ``attach(model, dump_dir=...)`` (:mod:`.subscriber`, on the session's bus) or, without
torch, :class:`~tensordbg.dump.writer.DumpWriter`. Reading: :func:`load` (numpy only). The layout
on disk: :mod:`.format`.
"""

from __future__ import annotations

from tensordbg.dump.reader import Dump, DumpedTensor, DumpError, TensorEntry, load

__all__ = ["Dump", "DumpError", "DumpedTensor", "TensorEntry", "load"]
