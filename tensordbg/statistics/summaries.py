"""What a person asks of a tensor: its summary (counts, range, moments) and a histogram.

A summary is computed next to the tensor, on its device, as one float64 vector
(:func:`summary_vector`), and made on the host (:func:`summary_from`). A tensor of any size is
read in chunks (:func:`streamed_summary`, :func:`streamed_histogram`), so that a request for a
large slice while the training waits makes it allocate a chunk's worth
(:data:`CHUNK_ELEMENTS`), never a copy of the slice."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from tensordbg.statistics.registry import Summary
from tensordbg.statistics.torch_kernels import _F64, _KERNELS, Cache, _aminmax, _reducible

__all__ = [
    "CHUNK_ELEMENTS",
    "chunks",
    "next_nonfinite",
    "streamed_histogram",
    "streamed_summary",
    "summarize",
    "summary_from",
    "summary_vector",
]


# Order of the values in a summary vector; see summary_vector.
_SUMMARY_FIELDS = (
    "numel", "nan", "posinf", "neginf", "zeros", "min", "max", "mean", "std", "abs_mean", "l2",
)  # fmt: skip
# The moments after the range, each by its statistic's kernel.
_MOMENT_KERNELS = tuple(_KERNELS[name] for name in _SUMMARY_FIELDS[7:])


def summary_vector(t: Tensor) -> Tensor:
    """Everything :class:`~tensordbg.statistics.Summary` holds, as one float64 vector on the device.
    Moments are over finite elements, so a tensor with a few NaN still shows its range."""
    x = _reducible(t.detach()).reshape(-1)
    n = x.numel()
    finite = torch.isfinite(x)
    nonfinite = n - torch.count_nonzero(finite)
    # The common case pays no mask: one host read tells whether there is anything to mask.
    if int(nonfinite):
        nan = torch.count_nonzero(torch.isnan(x))
        posinf = torch.count_nonzero(x == math.inf)
        neginf = nonfinite - nan - posinf
        x = x[finite]
    else:
        nan = posinf = neginf = torch.zeros((), dtype=torch.int64, device=x.device)
    zeros = x.numel() - torch.count_nonzero(x)
    counts = torch.stack([torch.tensor(n, device=x.device), nan, posinf, neginf, zeros]).to(_F64)
    if x.numel() == 0:
        moments = torch.full((6,), math.nan, dtype=_F64, device=x.device)
    else:
        cache: Cache = {}
        m = x.numel()
        lo_hi = torch.stack(_aminmax(x, cache)).to(_F64)
        rest = torch.stack([kernel(x, m, cache, ()).to(_F64) for kernel in _MOMENT_KERNELS])
        if not math.isfinite(sum(rest.tolist())):  # one read of four numbers
            # Finite values whose sums pass the dtype's range (near 3e38 in float32) read
            # "mean nan, std nan": the moments are of degree one, so they are taken over the
            # values scaled into [-1, 1] and scaled back.
            scale = lo_hi.abs().max()
            y, shared = x / scale.to(x.dtype), {}
            rest = torch.stack([k(y, m, shared, ()).to(_F64) for k in _MOMENT_KERNELS]) * scale
        moments = torch.cat((lo_hi, rest))
    return torch.cat((counts, moments))


def summary_from(values: Sequence[float]) -> Summary:
    """The :class:`Summary` for a vector made by :func:`summary_vector`, on the host."""
    data = dict(zip(_SUMMARY_FIELDS, values, strict=True))
    for key in ("numel", "nan", "posinf", "neginf", "zeros"):
        data[key] = int(data[key])
    if (
        data["posinf"] + data["neginf"]
        and data["numel"] == data["nan"] + data["posinf"] + (data["neginf"])
    ):  # nothing finite: the range is the infinities there are, not NaN
        data["min"] = -math.inf if data["neginf"] else math.inf
        data["max"] = math.inf if data["posinf"] else -math.inf
    return Summary(**data)


def summarize(t: Tensor) -> Summary:
    """The summary of a tensor, on the host (synchronizes with the device)."""
    return summary_from(summary_vector(t).tolist())


CHUNK_ELEMENTS = 1 << 22
"""Elements a streamed statistic reads at once: its temporaries (a float64 copy, masks) stay
within ~64 MiB however large the tensor (see :func:`chunks`)."""


def chunks(t: Tensor, size: int = CHUNK_ELEMENTS) -> Iterator[Tensor]:
    """``t``'s elements as flat pieces of at most ``size`` elements, in order, each a view of
    ``t`` or a copy of at most ``size`` elements: walking a strided view never copies it whole."""
    x = t.detach()
    if x.numel() <= size or x.dim() == 0:
        yield x.reshape(-1)
        return
    row = x[0].numel() if x.shape[0] else 1
    if row > size:
        for i in range(x.shape[0]):
            yield from chunks(x[i], size)
        return
    step = max(1, size // max(row, 1))
    for start in range(0, x.shape[0], step):
        yield x[start : start + step].reshape(-1)


def streamed_summary(t: Tensor, size: int = CHUNK_ELEMENTS) -> Summary:
    """The :class:`Summary` of a tensor of any size, read in chunks (:func:`chunks`) with the
    moments combined exactly (Chan et al.'s pairwise update, in float64). Small tensors take
    one chunk: the result is :func:`summarize`'s."""
    if t.numel() <= size:
        return summarize(t)
    n = nan = posinf = neginf = zeros = 0
    count, mean, m2, abs_sum, sq_sum = 0, 0.0, 0.0, 0.0, 0.0
    lo, hi = math.inf, -math.inf
    for piece in chunks(t, size):
        x = _reducible(piece).to(_F64)
        n += x.numel()
        finite = torch.isfinite(x)
        bad = x.numel() - int(torch.count_nonzero(finite))
        if bad:
            k_nan = int(torch.count_nonzero(torch.isnan(x)))
            k_pos = int(torch.count_nonzero(x == math.inf))
            nan, posinf, neginf = nan + k_nan, posinf + k_pos, neginf + bad - k_nan - k_pos
            x = x[finite]
        k = x.numel()
        if not k:
            continue
        zeros += k - int(torch.count_nonzero(x))
        c_lo, c_hi = (v.item() for v in torch.aminmax(x))
        lo, hi = min(lo, c_lo), max(hi, c_hi)
        c_mean = x.sum().item() / k
        centered = x - c_mean
        c_m2 = torch.dot(centered, centered).item()
        abs_sum += x.abs().sum().item()
        sq_sum += torch.dot(x, x).item()
        delta = c_mean - mean
        total = count + k
        mean += delta * k / total
        m2 += c_m2 + delta * delta * count * k / total
        count = total
    if not count:
        return Summary(numel=n, nan=nan, posinf=posinf, neginf=neginf)
    return Summary(numel=n, nan=nan, posinf=posinf, neginf=neginf, zeros=zeros, min=lo, max=hi,
                   mean=mean, std=math.sqrt(m2 / count), abs_mean=abs_sum / count,
                   l2=math.sqrt(sq_sum))  # fmt: skip


def streamed_histogram(t: Tensor, bins: int, lo: float, hi: float,
                       size: int = CHUNK_ELEMENTS) -> list[int]:  # fmt: skip
    """Counts of ``t``'s finite elements in ``bins`` equal bins over ``[lo, hi]`` (``torch.histc``'s
    rule: the last bin holds ``hi``; values outside are not counted), read in chunks."""
    counts = torch.zeros(bins, dtype=torch.int64)
    for piece in chunks(t, size):
        x = piece if piece.dtype in (torch.float32, _F64) else _reducible(piece).float()
        x = x[torch.isfinite(x)] if not bool(torch.isfinite(x).all()) else x
        if x.numel():
            counts += torch.histc(x, bins=bins, min=lo, max=hi).to(torch.int64).cpu()
    return counts.tolist()


def next_nonfinite(
    t: Tensor, after: int = -1, size: int = CHUNK_ELEMENTS
) -> tuple[int, bool] | None:
    """Where the next NaN or Inf of ``t`` lies: its flat (row-major) position after ``after``,
    and False; else the first one at or before ``after`` (the search wrapped round), and True;
    None when there is none. Read in chunks (:func:`chunks`): what it allocates is a chunk's
    mask, a byte an element, however large ``t`` is."""
    if not (t.is_floating_point() or t.is_complex()) or not t.numel():
        return None
    wrapped = None
    start = 0
    for piece in chunks(t, size):
        end = start + piece.numel()
        cut = min(max(0, after + 1 - start), piece.numel())  # this piece's part at or before
        if cut < piece.numel():
            found = _first_nonfinite(piece[cut:])
            if found is not None:
                return start + cut + found, False
        if wrapped is None and cut:
            found = _first_nonfinite(piece[:cut])
            wrapped = None if found is None else start + found
        start = end
    return None if wrapped is None else (wrapped, True)


def _first_nonfinite(flat: Tensor) -> int | None:
    x = flat if flat.is_complex() else _reducible(flat)
    bad = torch.isfinite(x).logical_not_()
    if not bool(bad.any()):
        return None
    return int(bad.view(torch.uint8).argmax())  # the first of the largest: the first NaN or Inf
