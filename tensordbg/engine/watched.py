"""Which modules of a model the hooks watch, what parameters each holds, and which of them
need no pre-hook (part of :mod:`.capture`)."""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

import torch

from tensordbg.engine.fused import FUSED

_PURE_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
_NEVER_CALLED = (torch.nn.ModuleList, torch.nn.ModuleDict)


def watched_modules(
    model: torch.nn.Module, include: tuple[str, ...], exclude: tuple[str, ...]
) -> tuple[dict[int, str], dict[int, str], dict[int, tuple[str, ...]]]:
    """The modules to hook, by id: their paths, their types' names, and the parameters each
    holds as its own (:func:`_held_params`). ``include``/``exclude``: path patterns."""
    paths: dict[int, str] = {}
    types: dict[int, str] = {}
    for path, module in model.named_modules():
        if path and not _selected(path, include, exclude):
            continue
        if type(module) in _NEVER_CALLED or ("." in path and type(module) in _PURE_CONTAINERS):
            # A list or dict of modules has no forward; a Sequential's only chains its
            # children, inside its parent's forward. (A child of the root is hooked: a GAN
            # calls G(z) and D(x) itself, and each is a root forward whose children must
            # share its call tree.)
            continue
        paths[id(module)] = path
        types[id(module)] = type(module).__name__
    named = {id(p): n for n, p in model.named_parameters()}  # a tied one by its first name
    direct: dict[int, tuple[str, ...]] = {}
    for path, module in model.named_modules():
        if id(module) in paths:  # (a fused kernel uses its submodules' parameters)
            held = {} if isinstance(module, FUSED) else paths
            direct[id(module)] = _held_params(module, path, held, named)
    return paths, types, direct


def enters_late(module: torch.nn.Module, root: torch.nn.Module, random: set[int],
                notes_forward: bool) -> bool:  # fmt: skip
    """Whether a module's call is entered in its post-hook, with no pre-hook: a leaf of
    torch.nn (no child module; its own code calls no hooked module) that changes no input in
    place (its inputs' versions are as they came in) and draws no random numbers (``random``:
    their draw is kept before they run), in a session that only notes a clean forward
    (``notes_forward``: deferred on the host, where no check runs before a call returns)."""
    return (notes_forward and module is not root and not module._modules
            and id(module) not in random and not getattr(module, "inplace", False)
            and type(module).__module__.startswith("torch.nn.modules."))  # fmt: skip


def _selected(path: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    if include and not any(fnmatchcase(path, p) for p in include):
        return False
    return not any(fnmatchcase(path, p) for p in exclude)


def _held_params(module: torch.nn.Module, path: str, watched: Mapping[int, str],
                 named: Mapping[int, str]) -> tuple[str, ...]:  # fmt: skip
    """A watched module's own parameters, and those of its submodules that are not watched
    (left out by ``include``/``exclude``): to the call tree they are its own code's (a NaN
    weight of an unwatched layer explains the outputs of the call around it, not "made by its
    own code"). By the names they are watched under (``named``: a tied one by its first)."""
    names = [named.get(id(p), n) for n, p in module.named_parameters(prefix=path, recurse=False)]
    for name, child in module.named_children():
        if id(child) not in watched:
            names += _held_params(child, f"{path}.{name}" if path else name, watched, named)
    return tuple(dict.fromkeys(names))
