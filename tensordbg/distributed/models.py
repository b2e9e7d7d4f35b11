"""Models as data parallelism wraps them, and parameters as FSDP2 shards them.

``DistributedDataParallel`` (and ``DataParallel``) hold the user's model as ``.module``: its
``named_modules()`` paths all start with ``module.``. tensordbg watches the inner model, so
every path, hit and rule pattern is named as in the user's own model (``blocks.0.attn``, never
``module.blocks.0.attn``), whichever of the two the script passes to ``attach``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) makes parameters ``DTensor``s: any reduction on
one (a norm, a sum) would run a collective on the training's process group, which tensordbg
never does. Their statistics are those of the rank's local shard, and their names say so.
"""

from __future__ import annotations

from typing import Any

import torch

SHARD_SUFFIX = " (local shard)"


def unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The user's model inside a data-parallel wrapper, and the wrapper (None when unwrapped).

    >>> inner, wrapper = unwrap(DistributedDataParallel(model))
    >>> inner is model
    True
    """
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    if isinstance(model, wrappers) and isinstance(getattr(model, "module", None),
                                                  torch.nn.Module):  # fmt: skip
        return model.module, model
    return model, None


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2, tensor parallelism), without importing the
    DTensor package when nothing uses it."""
    cls = type(tensor)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a ``DTensor`` (the tensor itself otherwise); reading it runs no
    collective."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def watch_local_shards(session: Any) -> list[str]:
    """Make the session read each ``DTensor`` parameter through this rank's local shard (a view:
    the optimizer's in-place updates show in it); returns their names. Their gradients are not
    watched: FSDP2 sets them after its reduce-scatter, outside the hooks autograd offers."""
    sharded = []
    with torch.no_grad():
        for p in session.weights.params.values():
            if is_dtensor(p.param):
                p.param = p.param.to_local()
                sharded.append(p.name)
    return sharded
