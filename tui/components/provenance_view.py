"""The Provenance tab: which module produced a tensor, from which inputs (finite or not), who
consumed it, and the line of the user's code that made the call, with the stack."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.segment import Segment
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.strip import Strip
from textual.widgets import Static, Tree

from tensordbg.tui.components.line_table import strip_style
from tensordbg.tui.errors import work
from tensordbg.tui.messages import OpenTensor
from tensordbg.tui.remote import RequestFailed, remote_of


def finiteness(flag: bool | None) -> Text:
    if flag is None:
        return Text("? not checked", style="dim")
    return Text("✗ non-finite", style="bold red") if flag else Text("✓ finite", style="green")


def source_listing(source: dict[str, Any]) -> Group:
    """The user's line in its context, line numbers in the margin, the line itself marked."""
    header = Text(f"{source['file']}:{source['line']} in {source['function']}", style="bold")
    lines = [header]
    width = max((len(str(n)) for n, _ in source.get("context", [])), default=1)
    for number, code in source.get("context", []):
        here = number == source["line"]
        line = Text("→ " if here else "  ", style="bold yellow")
        line.append(f"{number:>{width}} ", style="dim")
        line.append(code, style="bold reverse" if here else "")
        lines.append(line)
    return Group(*lines)


NOTHING_OPEN = (
    "No tensor is open. Open one first: Enter on a hit in the Hits tab (F2), or on a module in "
    "the Modules tab (F3) and then on one of its tensors. This tab then shows which module "
    "made it, from which inputs, and the line of your code that called it."
)


GRADIENTS = ("grad", "grad_output", "grad_input")
BACKWARD_LINE = (
    "Made in backward, which runs no line of yours: below is the forward call this gradient "
    "flows back through, not the line that made a NaN in it. torch.autograd.detect_anomaly() "
    "names the forward line of the backward operation that made one."
)


class ProvenanceTree(Tree[dict[str, Any] | None]):
    """The tree, a line cut by the right edge ending in ``…`` there (→ scrolls to the rest), as
    the Modules tab's lines do: an input's summary cut to "tensor[16,31,64] floa" read as
    whole."""

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.size.width
        # Tree's own line, from the scroll position to its end (Tree crops it to the width).
        end = scroll_x + max(self.virtual_size.width, width)
        line = self._render_line(y + scroll_y, scroll_x, end, self.rich_style)
        if width and line.crop(width).text.strip():
            cut = line.crop(0, width - 1)
            return Strip([*cut, Segment("…", strip_style(cut))])
        return line.crop(0, width)


class ProvenanceView(VerticalScroll):
    """Fed by :meth:`load` with a tensor's ref; Enter on an input opens that input. Until a
    tensor is open, the source box says how to open one."""

    def __init__(self) -> None:
        super().__init__(id="provenance-view")

    def compose(self) -> ComposeResult:
        tree = ProvenanceTree("No tensor open", id="provenance-tree")
        tree.show_root = True
        yield tree
        source = Static(NOTHING_OPEN, id="provenance-source")
        source.border_title = "source"
        yield source
        yield Static("", id="provenance-stack")

    @work(group="provenance", exclusive=True)
    async def load(self, ref: int, module: str | None = None, call: int = 0,
                   name: str = "") -> None:  # fmt: skip
        try:
            prov = await remote_of(self).provenance(ref, module, call)
        except RequestFailed as e:  # the tensor by its name (its ref is the source's own id)
            self.show_message(f"No provenance for {name or 'this tensor'}: {e.message}")
            return
        self.show(prov)

    def show_message(self, text: str) -> None:
        """A sentence in place of the provenance: in the box below the tree, which wraps it (a
        tree's label is one line: "...kept only for the phase the t" was all it showed)."""
        tree = self.query_one(Tree)
        tree.clear()
        head, _, _ = text.partition(": ")
        tree.root.set_label(head)
        self.query_one("#provenance-source", Static).update(Text(text))
        self.query_one("#provenance-stack", Static).update("")

    def show(self, prov: dict[str, Any]) -> None:
        tree: Tree[dict[str, Any] | None] = self.query_one(Tree)
        tree.clear()
        # Its step: after `s` or `c` the tab still shows the tensor it was opened on.
        step = f", step {prov['step']}" if "step" in prov else ""
        tree.root.set_label(Text.assemble((prov["name"], "bold"), f"  ({prov['kind']}{step})"))
        producer = prov.get("producer")
        if producer:
            label = Text("produced by ", style="dim")
            label.append(producer["module"] or "(model)", style="bold")
            label.append(f"  {producer['type']}, call {producer['call']}")
            returned_by = prov.get("returned_by")
            if returned_by:
                label.append("  by its own code, returned through ", style="dim")
                label.append(returned_by["module"], style="bold")
            tree.root.add_leaf(label)
            operation = prov.get("operation")
            if operation:  # named by running the producer's forward again (engine/pinpoint.py)
                # Which it made, NaN or Inf: a call that made both has the first named.
                what = operation.get("value") or "non-finite value"
                made = Text(f"first {what} made by ", style="dim")
                made.append(operation["op"], style="bold")
                # Its line on a line of its own: at 80 columns, one line cut the code short.
                line = Text(f"line {operation['line']}: ", style="dim")
                line.append(operation["code"])
                tree.root.add(made, expand=True, allow_expand=False).add_leaf(line)
        else:
            made = ("a parameter: no call of this step made its value (the last update, a "
                    "load, or code that set it)") if prov.get("kind") == "param" else (
                    "produced outside any module")  # fmt: skip
            tree.root.add_leaf(Text(made, style="dim"))
        inputs = tree.root.add(f"inputs ({len(prov.get('inputs', []))})", expand=True)
        for item in prov.get("inputs", []):
            label = finiteness(item.get("nonfinite"))
            label.append(f"  {item['name']}  ", style="bold")
            came = item["module"] or ("(model)" if item.get("ref") is not None else "not judged")
            if item.get("made_by") == "code":  # made between modules, not returned by one
                came = f"{item['module'] or '(model)'}'s own code"  # judged or not
            elif item.get("made_by"):  # given to the model's first call (its root)
                came = item["made_by"]
            label.append(f"← {came}  ", style="dim")
            label.append(item.get("line") or f"tensor{item['shape']} {item['dtype']}")
            inputs.add_leaf(label, data=item)
        consumers = tree.root.add(f"consumers ({len(prov.get('consumers', []))})", expand=True)
        for item in prov.get("consumers", []):
            consumers.add_leaf(
                f"{item['module'] or '(model)'}  {item['type']}, call {item['call']}"
            )
        if not prov.get("consumers") and prov.get("kind") in ("output", "input"):
            # Paused in the forward, the call that takes it may not have run yet.
            later = (", or the call that takes it has not run yet (the training paused before "
                     "it)") if getattr(self.app, "state", "") == "paused" else ""  # fmt: skip
            consumers.add_leaf(
                Text(
                    "no module call took it so far: code between modules used it "
                    f"(x + self.attn(x)), or it is what the model returned{later}",
                    style="dim",
                )
            )
        tree.root.expand()
        source = prov.get("source")
        box = self.query_one("#provenance-source", Static)
        listing: Any = (
            source_listing(source)
            if source
            else Text("The call's source line is not known.", style="dim")
        )
        # A gradient is made in backward: its line is the forward call it flows back through,
        # not where a NaN of it came from (the arrow read as if it were, trying it as a new user).
        gradient = prov.get("kind") in GRADIENTS
        box.border_title = "the forward call it flows back through" if gradient else "source"
        if gradient and source:
            listing = Group(Text(BACKWARD_LINE, style="dim"), listing)
        box.update(listing)
        stack = Text("Stack (innermost last)\n", style="bold")
        for file, line, function in prov.get("stack", []):
            here = source is not None and file == source["file"] and line == source["line"]
            stack.append(
                f"{'→' if here else ' '} {file}:{line} in {function}\n",
                style="yellow" if here else "",
            )
        self.query_one("#provenance-stack", Static).update(stack)

    @on(Tree.NodeSelected)
    def _open_input(self, event: Tree.NodeSelected) -> None:
        event.stop()
        item = event.node.data
        if item and item.get("ref") is not None:
            self.post_message(OpenTensor(item["ref"], item["name"]))
