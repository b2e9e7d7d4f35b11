"""The rules a dump was recorded with, rebuilt from its metadata for ``tensordbg check``.

>>> recorded_rules({"rules": [{"name": "NaN"}, {"name": "Overflow", "params": {"near": 0.5}}]})
[NaN(), Overflow(near=0.5)]
"""

from __future__ import annotations

from typing import Any

from tensordbg.rules import Rule, available_rules, default_rules


def recorded_rules(meta: dict[str, Any], notes: list[str] | None = None,
                   unchecked: list[str] | None = None) -> list[Rule]:  # fmt: skip
    """The rules a dump's metadata names, with their thresholds and selections, else the
    default rules. A rule that cannot be rebuilt here (not installed, thresholds it no longer
    takes) is left out, with a sentence in ``notes`` and its name in ``unchecked``; so is
    falling back on the default rules when none is left."""
    recorded = meta.get("rules")
    if not recorded:
        return default_rules()
    if not isinstance(recorded, list):
        _note(notes, f"the run's rules in its metadata are not a list ({type(recorded).__name__}):"
                     " checked with the default rules instead")  # fmt: skip
        return default_rules()
    available = available_rules()
    out = []
    for spec in recorded:
        spec = spec if isinstance(spec, dict) else {"name": str(spec)}
        name = str(spec.get("name", ""))
        if spec.get("enabled") is False:
            continue
        cls = available.get(name)
        if cls is None:
            _note(notes, f"the run's rule {name} is not installed here: it was not checked")
            _note(unchecked, name)
            continue
        selection = {k: spec[k] for k in ("match", "exclude", "kinds") if spec.get(k)}
        params = {k: _number(v) for k, v in (spec.get("params") or {}).items() if v is not None}
        try:
            out.append(cls(**selection, **params))
        except (TypeError, ValueError) as e:
            _note(notes, f"the run's rule {name} cannot be rebuilt here ({e}): it was not checked")
            _note(unchecked, name)
    if not out:
        _note(notes, "none of the run's rules can be used here: checked with the default rules "
                     "instead")  # fmt: skip
        return default_rules()
    return out


def _note(notes: list[str] | None, text: str) -> None:
    if notes is not None:
        notes.append(text)


def _number(value: Any) -> Any:
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, list):
        return tuple(value)
    return value
