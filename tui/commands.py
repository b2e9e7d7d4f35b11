"""The command palette's entries on the main screen: the debugger's controls that make sense
in the training's state, the tabs, the profile's views."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual.app import SystemCommand
from textual.screen import Screen

from tensordbg.tui.profiler.view import VIEWS
from tensordbg.tui.remote import OVER
from tensordbg.tui.screens.main import TABS

DETACHED = "the training goes on, unwatched"
"""What q does to the training (one that ends with the UI, tensordbg demo's, is not detached)."""
ENDS_WITH_UI = "the training stops with the UI, as tensordbg demo's does"


def detached(info: dict[str, Any]) -> str:
    """What q leaves of the training whose ``info`` the UI shows: of a job of several ranks,
    only this rank's session detaches, and the others still watch theirs."""
    ranks, rank = info.get("world_size") or 1, info.get("rank") or 0
    if not isinstance(ranks, int) or ranks < 2:
        return DETACHED
    others = [str(r) for r in range(ranks) if r != rank]
    still = f"rank {others[0]} is" if len(others) == 1 else f"ranks {', '.join(others)} are"
    return f"rank {rank} goes on unwatched; {still} still watched (tensordbg tui reaches them)"


# Which control actions make sense in which state of the training.
CONTROLS = {"paused": ("continue", "next", "step", "skip"), "running": ("pause",)}
COMMANDS = (
    ("continue", "Continue", "Run to the next new problem: a new origin hit (c)"),
    ("next", "Next hit", "Run to the next hit of any kind (n)"),
    ("step", "Step", "Run one training step, then pause (s; 5s runs five)"),
    ("pause", "Pause", "Pause the training as soon as possible (p)"),
    (
        "skip",
        "Skip this update",
        "Drop this step's gradients: the parameters and the optimizer's "
        "state stay as they are, as a GradScaler skips an overflow (k)",
    ),
)


def cannot_skip(hit: dict[str, Any] | None) -> str:
    """Why ``k`` cannot skip the update of the step paused in, paused on ``hit`` (the session's
    ``skippable`` is false: every optimizer of the step has stepped, and the hit was found in
    what the update wrote; ``OptimizerPhase.skippable``)."""
    step = f"Step {hit['step']}'s" if hit else "This step's"
    return (f"{step} update is made already: the training paused after the optimizer step, on a "
            "hit found in the weights it wrote, so there is nothing left to skip. k drops an "
            "update from a pause before it lands: at a hit in the forward or backward phase, "
            "such as the gradient's. c continues with these weights.")  # fmt: skip


def ignored(app: Any, hit: dict[str, Any], now: bool = False) -> bool:
    """Whether ``i`` made the rules of ``hit``'s row ignore its tensor already, in this session
    (``now``: it does so now, and the footer is told). The app keeps what ``i`` asked for in
    ``app.ignoring`` (the rules' exclusions grow only by ``i``: the edit dialog leaves them)."""
    where = (app.info.get("run_id"), app.info.get("rank"))
    asked = {(*where, rule, hit["tensor"]) for rule in app.main.hit_table.rules_of(hit)}
    if now:
        app.ignoring |= asked
        app.refresh_bindings()
    return asked <= app.ignoring


def palette(app: Any, screen: Screen, own: Iterable[SystemCommand]) -> Iterable[SystemCommand]:
    """What the palette of ``app`` (the TensorDbgApp) offers on ``screen``; ``own``: Textual's
    entries to keep."""
    yield from own
    if screen is not app.main:  # the session list (dialogs have no palette): no session
        yield SystemCommand("Quit", "Leave tensordbg", app.action_quit)
        return
    drivable = app.remote.serves("control")  # a recorded run cannot be driven
    for action, title, help in COMMANDS:
        if action == "skip" and (not app.skippable or app.skip_asked):
            continue  # the update is made (k says why), or k was pressed at this pause
        if drivable and action in CONTROLS.get(app.state, ()):
            yield SystemCommand(title, help, lambda a=action: app.action_control(a))
    if app.can_ignore():  # not check_action: the palette, not the main screen, is on top
        yield SystemCommand(
            "Ignore this rule on this tensor",
            "The hit's rule stops judging its tensor, so c does not stop there again (i)",
            app.action_ignore,
        )
    if app.remote.serves("goto"):  # a recorded run
        yield SystemCommand("Quit", "Close this recorded run (q)", app.action_leave)
    elif app.state in OVER:  # nothing is left to detach from
        yield SystemCommand("Quit", "Leave tensordbg (q)", app.action_leave)
    elif app.ends_training:
        yield SystemCommand("Quit", f"Quit: {ENDS_WITH_UI} (q)", app.action_leave)
    else:
        yield SystemCommand(
            "Detach and quit",
            f"Detach the debugger and quit: {detached(app.info)} (q)",
            app.action_detach,
        )
    yield SystemCommand(
        "Search", "Filter the hits on the Hits tab, else the model tree (/)", app.action_search
    )
    for tab in TABS:
        yield SystemCommand(
            f"Show {tab.title}",
            f"Switch to the {tab.title} tab ({tab.key.upper()})",
            lambda p=tab.pane: app.main.show_tab(p),
        )
    if not app.main.profiler_view.under_way:  # the one under way says how far it has got
        yield SystemCommand(
            "Profile the next N steps",
            "Run torch.profiler around the next steps; the Profile tab shows where the time "
            "and memory went (P)",
            app.action_profile,
        )
    for n, view in enumerate(VIEWS, 1):
        yield SystemCommand(
            f"Show Profile: {view.title}",
            f"Switch to the {view.title} view of the Profile tab (view {n} of {len(VIEWS)}: "
            "F8 opens the tab, then F8 moves to the next view)",
            lambda v=view.key: app.show_profile_view(v),
        )
    # A recheck judges the step the training is paused in.
    if app.state == "paused" and app.remote.serves("recheck"):
        yield SystemCommand(
            "Recheck",
            "Judge the current step again with the rules as they are now",
            app.main.recheck,
        )
