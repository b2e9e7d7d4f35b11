"""Numpy-style slice text, parsed without evaluating anything, and the UI's 2-D window on it.

``parse_index("[0, :, 3:8:2]")`` gives ``(0, slice(None), slice(3, 8, 2))``, which indexes a torch
tensor and a numpy array alike. Only integers, ``:``-slices with a positive step (torch has no
negative one), ``...``, ``None`` (a new axis) and short lists of integers are accepted; anything
else is refused with the position of the problem. :func:`apply_index` judges an index against the
shape before indexing, so a live tensor and a dumped array refuse the same index with the same
sentence. This module never imports torch.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from typing import Any

MAX_TEXT = 200
MAX_LIST = 4096

Index = tuple[Any, ...]


class SliceError(ValueError):
    """Slice text that is not a valid numpy-style index, or does not fit the tensor's shape."""


def parse_index(text: str) -> Index:
    """Parse ``"[0, :, 3:8:2]"`` (brackets optional) into an index tuple; ``""`` is everything."""
    text = text.strip()
    if len(text) > MAX_TEXT:
        raise SliceError(f"slice text is {len(text)} characters; at most {MAX_TEXT} are accepted")
    if text.startswith("[") and text.endswith("]") and _balanced_outer(text):
        text = text[1:-1].strip()
    if not text or text == "[":  # the "[" that starts a new slice in the UI, and nothing after
        return ()
    try:
        tree = ast.parse(f"_[{text}]", mode="eval")
    except SyntaxError as e:
        col = max((e.offset or 3) - 3, 0)
        opened = _unclosed(text)
        if opened is not None:  # Python names the wrapper's "_[": the person's bracket it is
            col, e.msg = opened, f"'{text[opened]}' was never closed"
        raise SliceError(f"cannot read slice {text!r} near column {col + 1}: {e.msg}") from None
    node = tree.body
    if not isinstance(node, ast.Subscript) or not isinstance(node.value, ast.Name):
        raise SliceError(f"{text!r} is not one index: write it as [a, b:c, ...]")
    parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    index = tuple(_part(p, text) for p in parts)
    try:
        _check_steps(index)
    except SliceError as e:
        raise SliceError(f"cannot read slice {text!r}: {e}") from None
    return index


def _check_steps(index: Index) -> None:
    """Refuse a slice step below 1: numpy reads ``[::-1]`` backwards, torch refuses it, and an
    index means the same to both."""
    steps = [p.step for p in index if isinstance(p, slice) and p.step is not None]
    step = next((step for step in steps if step < 1), None)
    if step is not None:
        raise SliceError(f"a slice's step is a whole number from 1 up (a tensor is not read "
                         f"backwards), not {step}")  # fmt: skip


def _balanced_outer(text: str) -> bool:
    """True when the first '[' closes at the last character (so '[0][1]' keeps its brackets)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if depth == 0:
            return i == len(text) - 1
    return False


def _part(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Slice):
        return slice(*[_int_or_none(n, text) for n in (node.lower, node.upper, node.step)])
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return Ellipsis
    if isinstance(node, ast.Constant) and node.value is None:
        return None
    if isinstance(node, ast.List):
        if len(node.elts) > MAX_LIST:
            raise SliceError(f"an index list takes at most {MAX_LIST} integers")
        return [_int(e, text) for e in node.elts]
    return _int(node, text)


def _int_or_none(node: ast.AST | None, text: str) -> int | None:
    if node is None or (isinstance(node, ast.Constant) and node.value is None):
        return None
    return _int(node, text)


def _int(node: ast.AST, text: str) -> int:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _int(node.operand, text)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    fragment = ast.get_source_segment(f"_[{text}]", node) or "?"
    raise SliceError(
        f"{fragment!r} is not allowed in a slice: use integers, start:stop:step, ..., None "
        "or a list of integers"
    )


def format_index(index: Index) -> str:
    """The canonical text of an index: ``(0, slice(None), slice(3, 8, 2))`` gives
    ``"[0, :, 3:8:2]"``."""
    if not index:
        return ""
    return "[" + ", ".join(_format_part(p) for p in index) + "]"


def _format_part(part: Any) -> str:
    if isinstance(part, slice):
        start = "" if part.start is None else str(part.start)
        stop = "" if part.stop is None else str(part.stop)
        text = f"{start}:{stop}"
        return text if part.step is None else f"{text}:{part.step}"
    if part is Ellipsis:
        return "..."
    if part is None:
        return "None"
    if isinstance(part, list):
        return "[" + ", ".join(map(str, part)) + "]"
    return str(part)


def result_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    """The shape ``x[index]`` would have, worked out from the index alone (numpy's rules, for
    the parts :func:`parse_index` accepts), so that a request is judged before anything is
    computed. Integers and list entries out of range are refused here too."""
    _check_steps(index)
    parts = _expanded(shape, index)
    out: list[int] = []
    lists: list[int] = []
    dims = iter(shape)
    for part in parts:
        if part is None:
            out.append(1)
            continue
        n = next(dims)
        if isinstance(part, slice):
            out.append(len(range(*part.indices(n))))
        elif isinstance(part, list):
            bad = next((i for i in part if not -n <= i < n), None)
            if bad is not None:
                raise SliceError(f"index {bad} is out of range for a dim of size {n}")
            lists.append(len(part))
        elif not -n <= part < n:
            raise SliceError(f"index {part} is out of range for a dim of size {n}")
    if lists:
        size = max(lists)
        if any(k not in (1, size) for k in lists):
            raise SliceError(f"index lists of lengths {lists} cannot be combined")
        out.append(size)  # where numpy puts it does not change the size
    return tuple(out)


def _expanded(shape: tuple[int, ...], index: Index) -> list[Any]:
    """``index`` with its ``...`` and the dims it leaves out made ``:``, one part a dim (and
    ``None`` for each new axis)."""
    ellipses = sum(part is Ellipsis for part in index)
    if ellipses > 1:
        raise SliceError("an index can have only one ...")
    consumed = sum(part is not None and part is not Ellipsis for part in index)
    if consumed > len(shape):
        raise SliceError(
            f"{format_index(index)} has {consumed} {_plural(consumed, 'index')} "
            f"for {len(shape)} {_plural(len(shape), 'dim')}"
        )
    parts: list[Any] = []
    for part in index:
        if part is Ellipsis:
            parts.extend([slice(None)] * (len(shape) - consumed))
        else:
            parts.append(part)
    parts.extend([slice(None)] * (len(shape) - sum(p is not None for p in parts)))
    return parts


def axis_labels(shape: tuple[int, ...], index: Index) -> list[Sequence[int] | None]:
    """For each dim of ``x[index]``, the indices of ``x`` that its positions are (``[3, 2:5]``
    of an 8x10 tensor: ``[range(2, 5)]``): what the UI labels a slice's rows and columns with,
    not 0, 1, 2. None for a new axis, and for every dim when lists index together (numpy
    pairs their entries into one dim)."""
    parts = _expanded(shape, index)
    if sum(isinstance(part, list) for part in parts) > 1:
        return [None] * len(result_shape(shape, index))
    out: list[Sequence[int] | None] = []
    dims = iter(shape)
    for part in parts:
        if part is None:
            out.append(None)
            continue
        n = next(dims)
        if isinstance(part, slice):
            out.append(range(*part.indices(n)))  # a range: no list of a huge dim's indices
        elif isinstance(part, list):  # one list: its dim stays where it is
            out.append([i % n for i in part])
    return out


def apply_index(x: Any, index: Index, max_elements: int | None = None) -> Any:
    """``x[index]`` for a torch tensor or numpy array. The index is judged against the shape
    first, by the same rules for both (:func:`result_shape`): a misfit gets the same sentence
    whichever holds the values, not torch's words live and numpy's in a replay. With
    ``max_elements``, an index whose result would hold more values is refused before it is
    evaluated (a short list index can ask for many copies of a large tensor)."""
    if not index:
        return x
    dims = "x".join(map(str, tuple(x.shape)))
    shape = f"tensor of shape {dims}" if dims else "0-d tensor (one value, no index to take)"
    try:
        size = math.prod(result_shape(tuple(x.shape), index))
    except SliceError as e:
        raise SliceError(f"{format_index(index)} does not fit a {shape}: {e}") from None
    if max_elements is not None and size > max_elements:
        raise SliceError(
            f"{format_index(index)} would make {size:,} values; a slice may make at most "
            f"{max_elements:,} (as many as the tensor holds, or 2**20): narrow it"
        )
    try:
        return x[index]
    except (IndexError, TypeError, ValueError, RuntimeError) as e:
        text = format_index(index)
        raise SliceError(f"{text} does not fit a {shape}: {e}") from None


def grid_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Rows and columns of the 2-D view of a tensor: a 1-D tensor is one row, dims before the last
    are flattened into rows, a scalar is a 1x1 grid."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return math.prod(shape[:-1]), shape[-1]


def clamp_window(
    shape: tuple[int, ...], window: list[list[int]] | None, max_elements: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The window of the 2-D view to send, clipped to the grid; without ``window``, the whole
    grid. Refuses a window of more than ``max_elements``."""
    rows, cols = grid_shape(shape)
    if window is None:
        (r0, r1), (c0, c1) = (0, rows), (0, cols)
    else:
        if len(window) != 2 or any(len(w) != 2 for w in window):
            raise SliceError("a window is [[row0, row1], [col0, col1]]")
        (r0, r1), (c0, c1) = window
        r0, r1 = max(0, min(r0, rows)), max(0, min(r1, rows))
        c0, c1 = max(0, min(c0, cols)), max(0, min(c1, cols))
        r1, c1 = max(r0, r1), max(c0, c1)
    if (r1 - r0) * (c1 - c0) > max_elements:
        raise SliceError(
            f"that is {(r1 - r0) * (c1 - c0):,} values; at most {max_elements:,} are sent at "
            "once: narrow the slice"
        )
    return (r0, r1), (c0, c1)


def window_of(x: Any, rows: tuple[int, int], cols: tuple[int, int]) -> Any:
    """The ``rows`` x ``cols`` block of the 2-D view of ``x`` (torch tensor or numpy array)."""
    grid_rows, grid_cols = grid_shape(tuple(x.shape))
    flat = x.reshape(grid_rows, grid_cols)
    return flat[rows[0] : rows[1], cols[0] : cols[1]]


MAX_BINS = 1024
"""The most bins a histogram request may ask for."""


def check_histogram(bins: int, lo: float | None, hi: float | None) -> None:
    """Refuse a histogram request every source would refuse, before any work: a bin count out
    of range, bounds that are not finite numbers, reversed, or too far apart to bin."""
    if not 1 <= bins <= MAX_BINS:
        raise SliceError(f"bins is between 1 and {MAX_BINS}")
    for name, bound in (("lo", lo), ("hi", hi)):
        if bound is not None and not math.isfinite(bound):
            raise SliceError(f"histogram bound {name}={bound} is not a finite number")
    if lo is not None and hi is not None:
        if lo > hi:
            raise SliceError(f"histogram bounds: lo={lo:g} is above hi={hi:g}")
        if not math.isfinite(hi - lo):
            raise SliceError(f"histogram bounds {lo:g}..{hi:g} are too far apart to bin")


def slice_frame(
    shape: tuple[int, ...], window: list[list[int]] | None, max_elements: int
) -> dict[str, Any]:
    """The part of a slice reply that does not depend on where the values live: the grid the
    result is viewed as, and the window of it sent (at most ``max_elements`` values)."""
    rows, cols = clamp_window(shape, window, max_elements)
    grid_rows, grid_cols = grid_shape(shape)
    return {"shape": list(shape), "rows": grid_rows, "cols": grid_cols,
            "window": [list(rows), list(cols)]}  # fmt: skip


def _unclosed(text: str) -> int | None:
    """Where the first bracket of ``text`` that is never closed opens, if one is."""
    stack: list[int] = []
    for i, c in enumerate(text):
        if c in "[(":
            stack.append(i)
        elif c in "])" and stack:
            stack.pop()
    return stack[0] if stack else None


def found(
    ref: int, index: str, shape: tuple[int, ...], at: tuple[int, bool] | None
) -> dict[str, Any]:
    """The reply to ``find``: ``at`` is the flat position of the NaN or Inf found, and whether
    the search wrapped round to it (None: none in the slice)."""
    if at is None:
        return {"ref": ref, "index": index, "shape": list(shape), "at": None, "flat": None,
                "wrapped": False}  # fmt: skip
    flat, wrapped = at
    where, rest = [], flat
    for size in reversed(shape):  # its index (numpy's unravel_index), the last dim's first
        rest, i = divmod(rest, size)
        where.append(i)
    where.reverse()
    return {"ref": ref, "index": index, "shape": list(shape), "at": where, "flat": flat,
            "wrapped": wrapped}  # fmt: skip


def _plural(n: int, word: str) -> str:
    return word if n == 1 else {"index": "indices"}.get(word, f"{word}s")
