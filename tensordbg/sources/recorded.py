"""What a dump recorded (provenance, the rule configuration), as the plain data of the Source
schema; and the installed rules as the Rules tab lists them (live and replayed sources alike).
numpy-free, torch-free."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import Any

from tensordbg.rules import Rule, available_rules
from tensordbg.rules.base import summary_of
from tensordbg.sources import contract


def call_site(value: Any) -> contract.CallSite | None:
    if not isinstance(value, dict):
        return None
    return {"module": str(value.get("module", "")), "type": str(value.get("type", "")),
            "call": int(value.get("call", 0))}  # fmt: skip


def source_line(value: Any) -> contract.SourceLine | None:
    if not isinstance(value, dict) or "file" not in value:
        return None
    return {
        "file": str(value["file"]),
        "line": int(value.get("line", 0)),
        "function": str(value.get("function", "")),
        "context": [[int(c[0]), str(c[1])] for c in value.get("context") or [] if len(c) == 2],
    }


def operation(value: Any) -> dict[str, Any]:
    """The dumped operation that made a hit's first NaN/Inf, checked field by field (a dump is
    data from disk): ``{"operation": {...}}``, or nothing."""
    if not isinstance(value, dict):
        return {}
    try:
        keys = ("op", "file", "function", "code", "value")
        fields = {key: str(value.get(key, "")) for key in keys}
        lines = {key: int(value.get(key, 0)) for key in ("line", "first_line")}
        return {"operation": {**fields, **lines}}
    except (TypeError, ValueError):
        return {}


def _listed(value: Any) -> list[Any]:
    return [value] if isinstance(value, str) else list(value or [])


def plain(value: Any) -> Any:
    """A value msgpack carries and the UI shows: sequences as lists, inf and nan as text."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _default_params(cls: type[Rule]) -> dict[str, Any]:
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    out = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "match", "exclude", "kinds") or p.kind not in named:
            continue
        out[name] = plain(None if p.default is inspect.Parameter.empty else p.default)
    return out


def available() -> list[contract.AvailableRule]:
    """Every installed rule with its default thresholds, as the Rules tab lists them."""
    return [{"name": name, "doc": summary_of(cls), "params": _default_params(cls)}
            for name, cls in available_rules().items()]  # fmt: skip


def rule_dicts(recorded: Any, hits: dict[str, int]) -> list[contract.Rule]:
    """The rules a dump's metadata names, as the schema's rules (read only)."""
    out = []
    for i, spec in enumerate(recorded if isinstance(recorded, list) else []):
        spec = spec if isinstance(spec, dict) else {"name": str(spec)}
        name = str(spec.get("name", "?"))
        out.append(
            {
                "id": i,
                "name": name,
                "enabled": bool(spec.get("enabled", True)),
                "doc": str(spec.get("doc", "")),
                "params": {str(k): plain(v) for k, v in (spec.get("params") or {}).items()},
                "match": [str(m) for m in _listed(spec.get("match", ["*"]))],
                "exclude": [str(m) for m in _listed(spec.get("exclude", []))],
                "kinds": [str(m) for m in _listed(spec.get("kinds", []))],
                "disabled_reason": None,
                "hits": hits.get(name, 0),
            }
        )
    return out


GRADIENTS = ("grad_output", "grad_input")
"""The kinds of an activation's gradient: the only values a hit names after the call that took
them (a parameter's consumers are its module's calls, which use it, not take it)."""


def taken_by(
    made: dict[str, Any], module: str | None, call: int, hit: dict[str, Any] | None,
    entries: Iterable[Any], kind: str,
) -> dict[str, Any] | None:  # fmt: skip
    """A dumped gradient's provenance as its hit names it, when the hit names the call that
    took the value rather than its producer (that call's backward made it: ``attn.grad_input[0]``,
    dumped as ``ln1.grad_output``): made by that call, taken in turn by the producer's backward.
    Its inputs, line and stack are those of another value of the step made by that call (from
    ``entries``, the step's dumped tensors), when one was dumped; None when the hit names the
    producer, or when the value (of ``kind``) is no gradient of an activation: a parameter
    checked in the forward names its module, which only consumed it (as a live session's
    provenance does: ``record.grad_of`` is None)."""
    if module is None or kind not in GRADIENTS:
        return None
    site = next((c for c in made.get("consumers") or [] if isinstance(c, dict)
                 and c.get("module") == module and c.get("call", 0) == call), None)  # fmt: skip
    if site is None:
        return None
    same_call = next(
        (e.provenance for e in entries if isinstance(e.provenance, dict)
         and e.provenance.get("producer") == site and not e.provenance.get("returned_by")),
        {},
    )  # fmt: skip
    producer = made.get("producer")
    return {
        "name": hit["tensor"] if hit else f"{module}.grad_input",
        "producer": site,
        "inputs": same_call.get("inputs") or [],
        "consumers": [producer] if isinstance(producer, dict) else [],
        "source": same_call.get("source"),
        "stack": same_call.get("stack") or [],
    }


def rule_dict(active: Any) -> dict[str, Any]:
    """A live session's rule as the UI gets it (``contract.Rule``)."""
    rule: Rule = active.rule
    return {
        "id": active.id,
        "name": rule.name,
        "enabled": active.enabled,
        "doc": rule.describe(),
        "params": {k: plain(v) for k, v in rule.params().items()},
        "match": list(rule.match),
        "exclude": list(rule.exclude),
        "kinds": sorted(rule.kinds),
        "disabled_reason": active.disabled_reason,
        "hits": active.hits,
    }


# --- a dump's steps and hits as the replay serves them ------------------------------------


def hit_dict(hit: Any) -> dict[str, Any]:
    out = hit.as_dict() if hasattr(hit, "as_dict") else dict(hit)
    out["summary"] = {k: v for k, v in (out.get("summary") or {}).items() if v is not None}
    return out


def step_numbers(numbers: Any, step: int, rank: int) -> dict[str, Any]:
    """The loss, gradient norm and rate the training recorded at ``step``, if it did."""
    if numbers is None:
        return {}
    try:
        return dict(numbers(step, rank=rank) or {})
    except Exception:  # a broken step: it has no numbers
        return {}


def call_of(name: str) -> int:
    """The call index a tensor's name carries (``block#1.output``), 0 without one."""
    head = name.split(".output")[0].split(".input")[0]
    _, sep, tail = head.rpartition("#")
    digits = tail.split(".")[0]
    return int(digits) if sep and digits.isdigit() else 0


def number(value: Any) -> float | None:
    """A recorded number as the Run tab takes it: NaN and Inf stay (it says where they are)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def nothing_dumped(dump: Any, broken: str) -> str:
    """Why a dump holds no step to show, in one sentence (a replay of it would show nothing)."""
    where = f"the dump {dump.path} holds no step"
    if broken:
        return f"{where} that can be read: {broken}"
    if not dump.meta.get("complete", True):
        return f"{where} yet: {dump.meta.get('reason_incomplete')}"
    every = dump.meta.get("dump_every")
    periodic = "it ended before its first periodic step" if every else "dump_every was not set"
    return f"{where}: no step of the run hit a rule and {periodic}, so there is nothing to replay"
