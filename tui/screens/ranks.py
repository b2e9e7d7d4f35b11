"""The ranks of one job (``torchrun``): which run and which are paused, the hits of every rank in
one list, and one tensor's statistics on every rank side by side.

Each rank serves its own session; this screen reads them all through one client per rank, which
the app opens (:func:`job_sessions`) and closes when the screen goes. Enter on a rank (or on a
hit) inspects that rank in the main screen; ``R`` (shift+r) there moves to the next rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label

from tensordbg.tui.components.table import Table
from tensordbg.tui.errors import reported, work

_PHASES = {"attach": -1, "forward": 0, "backward": 1, "optimizer": 2, "check": 3}
COMPARED = ("numel", "nan", "posinf", "neginf", "min", "max", "mean", "std", "l2")


def job_sessions(run_id: str, find: Callable[[], list[Any]] | None = None) -> list[Any]:
    """The live sessions of one job, by rank (connection files ``<run_id>-<rank>.json``)."""
    if find is None:
        from tensordbg.transport.connection import find_sessions as find
    return sorted((s for s in find() if _field(s, "run_id") == run_id),
                  key=lambda s: _field(s, "rank"))  # fmt: skip


def group_jobs(sessions: list[Any]) -> list[Any]:
    """One entry per job for the session picker: a job's lowest rank, its ``rank`` column
    saying which ranks run (``"0-3"``)."""
    jobs: dict[Any, list[Any]] = {}
    for s in sessions:
        jobs.setdefault(_field(s, "run_id"), []).append(s)
    out = []
    for ranks in jobs.values():
        ranks.sort(key=lambda s: _field(s, "rank"))
        first = ranks[0]
        if len(ranks) == 1:
            out.append(first)
            continue
        fields = ("script", "run_id", "pid", "host", "started", "path")
        entry = {name: _field(first, name) for name in fields}
        entry["rank"] = f"{_field(first, 'rank')}-{_field(ranks[-1], 'rank')}"
        out.append(entry)
    return out


def _field(session: Any, name: str) -> Any:
    return session.get(name) if isinstance(session, dict) else getattr(session, name, None)


class RanksScreen(Screen[int | None]):
    """Dismissed with the rank to inspect, or None (Esc)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss(None)", "Back"),
        Binding("a", "only(-1)", "All ranks"),
        *(Binding(str(d), f"only({d})", show=False) for d in range(10)),
    ]

    def __init__(self, run_id: str, clients: Mapping[int, Any], current: int = 0,
                 every: float = 1.0) -> None:  # fmt: skip
        super().__init__()
        self.run_id = run_id
        self.clients = dict(sorted(clients.items()))
        self.current = current
        self.every = every
        self.infos: dict[int, dict[str, Any]] = {}
        """Each rank's latest info; a rank whose session has ended keeps its last."""
        self.ended: set[int] = set()
        self.hits: dict[int, list[dict[str, Any]]] = {r: [] for r in self.clients}
        self.only: int | None = None
        """The rank whose hits are listed; None lists every rank's."""
        self._listed: list[dict[str, Any]] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="ranks-screen"):
            yield Label(f"run {self.run_id}: {len(self.clients)} ranks (Enter inspects one)",
                        id="ranks-title", classes="dialog-title")  # fmt: skip
            yield Table(id="ranks-table", cursor_type="row")
            yield Label("Hits of every rank (0-9: one rank, a: all)", id="ranks-hits-title")
            yield Table(id="ranks-hits", cursor_type="row")
            yield Label("", id="ranks-compare-title")
            yield Table(id="ranks-compare", cursor_type="none")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#ranks-table", DataTable).add_columns(
            "rank", "state", "step", "hits", "why it is paused, or how it ended"
        )
        self.query_one("#ranks-hits", DataTable).add_columns(
            "rank", "step", "phase", "rule", "tensor", "where"
        )
        self.query_one("#ranks-compare", DataTable).add_columns(
            "statistic", *(f"rank {r}" for r in self.clients)
        )
        self.refresh_ranks()
        self.set_interval(self.every, self.refresh_ranks)
        self.query_one("#ranks-hits", DataTable).focus()

    @work(group="ranks-refresh", exclusive=True)
    async def refresh_ranks(self) -> None:
        """Ask every rank where it is and for its new hits. A rank that does not answer has
        ended (its session closed with the training), unless it answers again: it keeps what
        was read of it."""
        changed = False
        for rank, client in self.clients.items():
            try:
                self.infos[rank] = await client.call("info")
                new = await client.call("hits", since=len(self.hits[rank]))
            except Exception:
                self.ended.add(rank)
                continue
            self.ended.discard(rank)
            if new:
                self.hits[rank].extend(new)
                changed = True
        self._show_ranks()
        if changed or not self._listed:
            self._show_hits()

    def _show_ranks(self) -> None:
        table = self.query_one("#ranks-table", DataTable)
        row = table.cursor_row
        table.clear()
        for rank in self.clients:
            info = self.infos.get(rank, {})
            mark = " *" if rank == self.current else ""
            state, why = info.get("state", "?"), info.get("pause_reason", "")
            if rank in self.ended:
                last = f" (last read: {state})" if info else ""
                state, why = "ended", f"its session closed{last}"
            table.add_row(f"{rank}{mark}", state, str(info.get("step", "")),
                          str(info.get("hits_total", "")), why[:80], key=str(rank))  # fmt: skip
        table.move_cursor(row=min(row, len(self.clients) - 1))
        if len(self.ended) == len(self.clients):
            self.query_one("#ranks-title", Label).update(
                f"run {self.run_id} has ended: its {len(self.clients)} ranks as last read"
            )

    def _show_hits(self) -> None:
        table = self.query_one("#ranks-hits", DataTable)
        table.clear()
        ranks = self.clients if self.only is None else [self.only]
        merged = [h | {"rank": r} for r in ranks for h in self.hits.get(r, [])]
        # In the order they happened: by step, then phase; a hit's id counts its own rank's
        # hits only (rank 0's 10th hit of step 5 came before rank 1's 3rd, of step 5's update).
        merged.sort(key=lambda h: (h["step"], _PHASES.get(h["phase"], 3), h["rank"], h["id"]))
        self._listed = merged
        for i, h in enumerate(merged):
            table.add_row(str(h["rank"]), str(h["step"]), h["phase"], h["rule"], h["tensor"],
                          "origin" if h["origin"] else "passed on", key=str(i))  # fmt: skip
        shown = "every rank" if self.only is None else f"rank {self.only}"
        self.query_one("#ranks-hits-title", Label).update(
            f"Hits of {shown}: {len(merged)} (0-9: one rank, a: all)"
        )

    def action_only(self, rank: int) -> None:
        self.only = None if rank < 0 or rank not in self.clients else rank
        self._show_hits()

    @on(DataTable.RowHighlighted, "#ranks-hits")
    @reported
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key.value is not None and int(event.row_key.value) < len(self._listed):
            self.compare(self._listed[int(event.row_key.value)])

    @work(group="ranks-compare", exclusive=True)
    async def compare(self, hit: dict[str, Any]) -> None:
        """The hit's tensor on every rank: that rank's own hit on it when it has one, else the
        tensor of that name in the rank's phase, else the latest statistics of the module's
        tensor of that kind (not for a parameter's gradient: the module's latest is any of its
        parameters', a bias's beside a weight's hit)."""
        columns: dict[int, dict[str, Any]] = {}
        missing: list[str] = []  # why a rank's column is dashes (it said nothing)
        for rank, client in self.clients.items():
            same = [h for h in self.hits.get(rank, []) if h["tensor"] == hit["tensor"]]
            # A hit's summary with statistics in it: a gradient judged by its norm alone has
            # only its shape and dtype (every row said "-"), and the tensor is looked up.
            if same and "numel" in (same[-1].get("summary") or {}):
                columns[rank] = same[-1]["summary"]
                continue
            if rank in self.ended:
                missing.append(f"rank {rank}: its session has ended")
                continue
            summary, why = await _summary_of(client, hit)
            if summary is not None:
                columns[rank] = summary
            else:
                missing.append(f"rank {rank}: {why}")
        table = self.query_one("#ranks-compare", DataTable)
        table.clear()
        for name in COMPARED:
            table.add_row(name, *(_number(columns.get(r, {}).get(name)) for r in self.clients))
        why = f"; - for {'; '.join(missing)}" if missing else ""
        self.query_one("#ranks-compare-title", Label).update(
            f"{hit['tensor']} on every rank (step {hit['step']} on rank {hit['rank']}){why}"
        )

    @on(DataTable.RowSelected)
    @reported
    def _selected(self, event: DataTable.RowSelected) -> None:
        key = event.row_key.value
        if key is None:
            return
        if event.data_table.id == "ranks-table":
            self._inspect(int(key))
        elif event.data_table.id == "ranks-hits" and int(key) < len(self._listed):
            self._inspect(int(self._listed[int(key)]["rank"]))

    def _inspect(self, rank: int) -> None:
        """Back to the main screen on ``rank``, unless that rank's session has ended: nothing of
        it can be read there (Enter seemed to do nothing), and this list says so."""
        if rank in self.ended and rank != self.current:
            self.notify(f"Rank {rank}'s session has ended with the training: it cannot be "
                        "inspected, only what this list read of it is left.", title="Ranks",
                        markup=False)  # fmt: skip
            return
        self.dismiss(rank)


async def _summary_of(client: Any, hit: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The statistics of ``hit``'s tensor on a rank: its entry in the rank's phase (measured
    now if it is held and was only judged by its norm), else its module's latest of its kind;
    when there are none, why."""
    try:
        listed = await client.call("tensors")
        tensor = next((t for t in listed if t["name"] == hit["tensor"]), None)
        if tensor is not None and "numel" in (tensor.get("summary") or {}):
            return dict(tensor["summary"]), ""
        if tensor is not None and tensor.get("retained"):
            return dict((await client.call("stats", ref=tensor["ref"]))["summary"]), ""
        if hit["kind"] == "grad":
            # A module's latest gradient statistics are any of its parameters': not this one's.
            return None, ("no hit on it, and it is not a tensor of the phase this rank is in "
                          "now (a rank's tensors are its current phase's)")  # fmt: skip
        modules = await client.call("modules")
    except Exception as e:
        return None, f"not read ({e})"[:120]
    module = next((m for m in modules if m["path"] == hit["module"]), None)
    if module is None:
        return None, f"no module {hit['module']} on it"
    stats = module["stats"].get(hit["kind"])
    if stats is None:
        # Deferred checks measure no clean activation: none may ever come, "yet" promised one.
        return None, (f"no statistics of {hit['module']}'s {hit['kind']} on it (a clean one is "
                      "screened, not measured, by the default checks)")  # fmt: skip
    return stats, ""


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.6g}"
    return str(int(value)) if isinstance(value, float) else str(value)
