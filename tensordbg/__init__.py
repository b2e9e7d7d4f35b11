"""tensordbg: an interactive numerical debugger for PyTorch training.

>>> import tensordbg
>>> session = tensordbg.attach(model, optimizer=opt)       # default rules, pause on a hit
>>> for batch in loader:
...     loss = model(batch).loss
...     session.observe("loss", loss)
...     loss.backward(); opt.step(); opt.zero_grad()
>>> session.hits[0].message

Importing ``tensordbg`` does not import torch: the terminal UI (``tensordbg.tui``) and the wire
protocol run where torch is absent. ``attach`` and ``Session`` load it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensordbg.hit import Hit, WatchpointHit

__version__ = "0.1.0"
__all__ = ["Hit", "Session", "WatchpointHit", "__version__", "attach", "load", "profile", "rules"]

if TYPE_CHECKING:
    from tensordbg import rules
    from tensordbg.api import attach, profile
    from tensordbg.dump import load
    from tensordbg.engine.session import Session


def __dir__() -> list[str]:
    """The public names, those loaded on first use among them (tab completion offers them)."""
    return sorted(set(__all__) | {name for name in globals() if name.startswith("__")})


def __getattr__(name: str) -> Any:
    if name == "attach":
        from tensordbg.api import attach, profile

        return attach
    if name == "profile":
        from tensordbg.api import profile

        return profile
    if name == "Session":
        from tensordbg.engine.session import Session

        return Session
    if name == "load":
        from tensordbg.dump import load

        return load
    if name == "rules":
        import tensordbg.rules

        return tensordbg.rules
    raise AttributeError(f"module 'tensordbg' has no attribute {name!r}")
