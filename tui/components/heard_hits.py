"""The hits the UI has received, each counted once, by rule and by module.

The training says how many hits each rule and each module has when the UI asks (at a pause); the
hits that come after it resumes (or up to its end) are counted here, so that the Rules and
Modules tabs follow the Hits tab instead of staying as the pause left them.
"""

from __future__ import annotations

from typing import Any


class HeardHits:
    """Hits counted once each, by the rank and id the training gave them."""

    def __init__(self) -> None:
        self._ids: set[tuple[int, int]] = set()
        self.by_rule: dict[str, int] = {}
        self.by_module: dict[str, int] = {}

    def clear(self) -> None:
        """Another session, or the same one again: its hits are all re-sent."""
        self._ids, self.by_rule, self.by_module = set(), {}, {}

    def add(self, hits: list[dict[str, Any]]) -> bool:
        """Count the hits not counted yet; whether there were any."""
        new = False
        for hit in hits:
            key = (hit.get("rank", 0), hit.get("id", -1))
            if key[1] < 0 or key in self._ids:
                continue
            self._ids.add(key)
            self.by_rule[hit["rule"]] = self.by_rule.get(hit["rule"], 0) + 1
            module = hit.get("module", "")
            self.by_module[module] = self.by_module.get(module, 0) + 1
            new = True
        return new
