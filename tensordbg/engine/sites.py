"""Where in the user's code something happens: the first frame outside torch and tensordbg.

A module call is named by the line that called it (capture.py); an operation that made a NaN by
the line that ran it (pinpoint.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import CodeType
from typing import Any

import torch

_TORCH_DIR = str(Path(torch.__file__).parent)
# tensordbg's own code on the path from a hook to the user's code: the engine and the
# integrations that call the model for the user (not the demo: that is user code).
_PACKAGE = Path(__file__).parent.parent
_OWN_DIRS = tuple(str(_PACKAGE / name) + "/" for name in ("engine", "integrations"))
_OWN_FILES = frozenset({str(_PACKAGE / "api.py")})

_INTERNAL_CODE: dict[int, tuple[CodeType, bool]] = {}
"""Whether each code object seen is torch's or tensordbg's, by its id (a code object hashes its
whole contents: by id the lookup is ~8 us cheaper a module call in a cold cache). The entry holds
the code, so its id is not reused while it is there."""

HOOK_CALLER = 2
"""How deep a module hook of tensordbg's looks for the user's line: past its own frame and its
wrapper (:func:`~.marks.hook_of_ours`'s, which calls it directly outside a profile), which are
never the user's; in a profile :func:`~.marks.own_work`'s is one more, walked past as
tensordbg's. Each frame walked costs ~3 us in the cold cache that a module's kernels leave."""


def user_site(frame: Any, until: CodeType | None = None) -> tuple[CodeType, int] | None:
    """The first frame outside torch and tensordbg: the user's line that called the module.
    ``until``: None when the frame running that code comes first (a library module's forward
    run again by tensordbg: the line that called it is not on this stack)."""
    while frame is not None:
        code = frame.f_code
        known = _INTERNAL_CODE.get(id(code))
        if known is None:  # decided once per code object: this runs on every module call
            filename = code.co_filename
            internal = filename.startswith((_TORCH_DIR, *_OWN_DIRS)) or filename in _OWN_FILES
            known = _INTERNAL_CODE[id(code)] = (code, internal)
        if not known[1]:
            return code, frame.f_lineno
        if code is until:
            return None
        frame = frame.f_back
    return None


def _checkpoint_code() -> CodeType | None:
    try:
        from torch.utils.checkpoint import CheckpointFunction
    except ImportError:  # pragma: no cover - a torch without it
        return None
    return CheckpointFunction.forward.__code__


_CHECKPOINTED = _checkpoint_code()


def in_reentrant_checkpoint(frame: Any) -> bool:
    """Whether ``frame`` runs inside ``torch.utils.checkpoint(..., use_reentrant=True)``'s
    forward: its modules run without gradients, and are run again in backward, where a
    backward pass of their own gives their parameters gradients."""
    while frame is not None:
        if frame.f_code is _CHECKPOINTED:
            return True
        frame = frame.f_back
    return False


# The trainers that call the user's code and observe its loss from their own hooks: a line of
# theirs is not where the user's loss was computed. Told by the path, without importing them.
_FRAMEWORKS = frozenset({"lightning", "pytorch_lightning", "lightning_fabric", "transformers",
                         "accelerate"})  # fmt: skip


@functools.lru_cache(maxsize=1024)  # a path split each observed loss: ~10 us of its step
def in_framework(code: CodeType) -> bool:
    """Whether ``code`` is a training framework's own (Lightning, transformers, accelerate)."""
    return not _FRAMEWORKS.isdisjoint(Path(code.co_filename).parts)
