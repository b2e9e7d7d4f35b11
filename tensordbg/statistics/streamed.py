"""Statistics of a tensor of any size in bounded memory: what a person asks of a large slice
while the training waits (the summary, a histogram) is read in chunks, so a request makes the
training allocate a chunk's worth (:data:`CHUNK_ELEMENTS`), never a copy of the slice."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from tensordbg.statistics.registry import Summary
from tensordbg.statistics.torch_kernels import _F64, _reducible, summarize

__all__ = ["CHUNK_ELEMENTS", "chunks", "streamed_histogram", "streamed_summary"]


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
