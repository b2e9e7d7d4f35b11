"""What the twelfth trial of the UI found, driven at 80x24 as the tester did (tmux, a training
that goes Inf at step 6 and NaN at step 9): each test is one finding."""

from __future__ import annotations

import asyncio
from typing import Any

from fake_source import FakeSource
from test_tui import footer_keys, mounted, until
from test_tui_newcomer import screen_text

from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp

SMALL = (80, 24)


def many_hits(source: FakeSource, n: int, long_last: bool = True) -> list[dict[str, Any]]:
    """``n`` hits of one step, one line of message each; the last one's message long (the
    detail pane grows to show it)."""
    base = source._hits[1]
    hits = [
        dict(base, id=i, tensor=f"layer{i}.weight.grad", message=f"layer{i} holds a NaN.")
        for i in range(n)
    ]
    if long_last:
        hits[-1]["message"] = " ".join(["The update wrote it in from the gradient."] * 8)
    source._hits = hits
    source.paused_at = hits[0]
    return hits


def test_the_hit_under_the_cursor_stays_in_view_when_its_detail_grows() -> None:
    """Finding 1: the cursor moved to a hit with a long message (End here; live, the pause's
    hit selected): the move scrolled its row into view, then the detail below grew and the list,
    shorter, hid that row. The detail said "step 9" while the list showed step 6's rows."""
    source = FakeSource()
    many_hits(source, 30)

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SMALL) as pilot:
            await mounted(pilot)
            table = app.main.hit_table
            await until(pilot, lambda: app.state == "paused" and table.row_count == 30)
            await pilot.pause(0.1)
            assert "layer0.weight.grad" in screen_text(app)
            await pilot.press("end")
            await until(pilot, lambda: table.cursor == 29)
            await pilot.pause(0.2)
            shown = screen_text(app)
            assert "The update wrote it in" in shown  # the detail is the long one
            rows = [line for line in shown.splitlines() if line.startswith("3 ")]
            assert any("layer29.weight.grad" in line for line in rows), shown

    asyncio.run(flow())


def test_at_80_columns_a_modules_nan_shows_and_the_tree_has_room_for_more_modules() -> None:
    """Finding 2: at 80 columns a module's line is cut at the right edge, and its NaN flag was
    at the end: ``(model) TinyGPT 110.4K n=31744 x∈[-3.5, 6.35] μ=0.001…`` read as clean. The
    flag comes first now. And at 80x24 the tree showed 6 modules (the search box took three
    lines, a blank one more): it shows 8, with the tensors of the module still below."""
    source = FakeSource(modules=30)
    source.module_list[4]["type"] = "CausalSelfAttentionWithRotaryEmbedding"  # net.2: cut
    info = source.info  # deferred checks, as the demo's: the tab says why outputs may be blank
    source.info = lambda: {**info(), "sync": "deferred"}  # type: ignore[method-assign]

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SMALL) as pilot:
            await until(pilot, lambda: app.state == "paused")
            await pilot.press("f3")
            table = app.main.module_browser.table
            await until(pilot, lambda: table.row_count == 36 and table.has_focus)
            await pilot.pause(0.2)
            lines = screen_text(app).splitlines()
            net2 = next(line for line in lines if "CausalSelfAttention" in line)
            assert net2.rstrip().endswith("…")  # cut at the edge, and still says NaN
            assert "NaN×2!" in net2, net2
            top = round(table.scroll_y)
            area = table.scrollable_content_region
            shown = [m["path"] for m in table._modules[top : top + area.height - 1]]
            assert len(shown) >= 8, shown
            assert any(line.startswith(" Deferred checks read") for line in lines)
            assert any(line.startswith(" Tensors of") for line in lines)

    asyncio.run(flow())


class AfterTheUpdate(FakeSource):
    """Paused on a hit the optimizer step made (a weight it wrote NaN into): every update of the
    step is made, and the session says k cannot skip it any more (``skippable`` false), as
    ``tensordbg run`` does on train_fault.py's step 6 optimizer-phase hits."""

    def __init__(self) -> None:
        super().__init__()
        weight = dict(self._hits[1], id=2, tensor="fc1.weight", kind="param", phase="optimizer",
                      message="fc1.weight holds 128 NaN among 128 values.")  # fmt: skip
        self._hits.append(weight)
        self.paused_at = weight

    def info(self) -> dict[str, Any]:
        return {**super().info(), "skippable": False}


def test_k_after_the_update_says_why_it_cannot_skip() -> None:
    """Finding 3: paused on a hit found after the optimizer step, k did nothing visible (the
    footer rightly left it out; the hit's message speaks of k). It says why now, in a
    notification and the Log tab, as the other refused keys do; the session is sent nothing."""
    source = AfterTheUpdate()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SMALL) as pilot:
            await until(pilot, lambda: app.state == "paused" and app.main.hit_table.row_count == 3)
            await until(pilot, lambda: app.main.run_status.paused_at is not None)
            assert "k" not in footer_keys(app)
            await pilot.press("k")
            await until(pilot, lambda: bool(list(app._notifications)))
            said = " ".join(str(n.message) for n in app._notifications)
            assert "Step 3's update is made already" in said
            assert "after the optimizer step" in said and "forward or backward" in said
            log = " ".join(str(e) for e in app.main.event_log._entries)
            assert "Step 3's update is made already" in log
            assert ("skip", 1) not in source.controls
            # The palette does not offer the skip either.
            titles = [c.title for c in app.get_system_commands(app.main)]
            assert "Skip this update" not in titles and "Continue" in titles

    asyncio.run(flow())


def test_after_i_the_footer_no_longer_offers_i_for_that_hit() -> None:
    """Finding 4: i made the hit's rule ignore its tensor; the footer still said "i Ignore
    rule" for the same hit (a second i would add the tensor again). It is left out for that
    hit, and offered again for a hit of another tensor."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SMALL) as pilot:
            await mounted(pilot)
            table = app.main.hit_table
            await until(pilot, lambda: app.state == "paused" and table.row_count == 2)
            app.main.show_tab("hits")
            await until(pilot, lambda: table.current is not None and "i" in footer_keys(app))
            await pilot.press("i")
            await until(pilot, lambda: source._rules[0]["exclude"] == ["net.2.output"])
            await until(pilot, lambda: "i" not in footer_keys(app))
            assert not app.can_ignore()
            await pilot.press("down")  # the passed-on hit: another tensor
            await until(pilot, lambda: "i" in footer_keys(app))

    asyncio.run(flow())


def test_at_80_columns_the_run_tab_numbers_and_the_finished_header_are_whole() -> None:
    """Finding 4: at 80 columns the Run tab's numbers wrapped inside a value ("7.619 (step" over
    "28)"), and the header cut how the training ended ("its loss was NaN f…"). The numbers take
    two rows, each value whole; the header's title wraps."""
    source = FakeSource()
    source.state, source.paused_at, source.step = "running", None, 28
    ended = "the demo stopped: its loss was NaN for 3 steps"

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SMALL) as pilot:
            await until(pilot, lambda: app.state == "running")
            last = {"step": 28, "loss": float("nan"), "grad_norm": float("nan"),
                    "steps_per_sec": 7.619}  # fmt: skip
            source.emit("status", {"state": "running", "step": 29, "phase": "forward",
                                   "hits_total": 540, "last": last})  # fmt: skip
            source.emit("state", {"state": "finished", "step": 29, "reason": ended})
            await until(pilot, lambda: app.state == "finished")
            await pilot.pause(0.3)
            shown = screen_text(app)
            flat = " ".join(shown.split())
            assert "7.619 (step 28)" in shown, shown  # on one line
            assert "NaN (step 28)" in shown
            assert ended in flat and "NaN f…" not in shown, shown

    asyncio.run(flow())
