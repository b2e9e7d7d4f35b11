"""`tensordbg demo` in a real terminal (tmux): the hit screen, a tensor, a slice, quit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]


class Terminal:
    """A tmux session running one command, read and typed into like a person would."""

    def __init__(self, command: str, width: int = 160, height: int = 45):
        self.name = f"tdbg-{uuid.uuid4().hex[:8]}"
        # A tmux server of its own (its own socket, no user config): with the shared default
        # server, a session started while the previous test's server was exiting (its last
        # session killed) failed with "server exited unexpectedly" (CI, 2026-12-05).
        self.socket = Path(tempfile.gettempdir()) / f"{self.name}.tmux"
        self.tmux = ["tmux", "-S", str(self.socket), "-f", os.devnull]
        env = {**os.environ, "TERM": "xterm-256color"}
        env.pop("TMUX", None)  # run from inside tmux, it is still a server of its own
        for size in ("COLUMNS", "LINES"):  # the pane's size, not these (pytest-xdist sets 80x24)
            env.pop(size, None)
        subprocess.run(
            [*self.tmux, "new-session", "-d", "-s", self.name, "-x", str(width),
             "-y", str(height), f"{command}; sleep 120"],  # keep the pane to read it at the end
            check=True, env=env,
        )  # fmt: skip

    def screen(self) -> str:
        return subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-t", self.name], capture_output=True, text=True
        ).stdout

    def wait_for(self, *texts: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if all(t in screen for t in texts):
                return screen
            time.sleep(0.25)
        raise AssertionError(f"never saw {texts!r} on the screen:\n{self.screen()}")

    def press(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", self.name, *keys], check=True)

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)
        self.socket.unlink(missing_ok=True)


@pytest.mark.timeout(300)
def test_the_demo_pauses_at_the_broken_attention_and_lets_a_person_inspect_it():
    terminal = Terminal(f"{sys.executable} -m tensordbg.cli demo")
    try:
        # Stopped on the hit, the Hits tab comes forward with the origin under the cursor.
        terminal.wait_for("PAUSED", "● origin", "↳ passed on", timeout=120)
        terminal.wait_for("[NaN] blocks.0.attn.output  output of blocks.0.attn", "Enter opens")
        # To the Log tab and back, then open its tensor, typed at once: the Enter was lost
        # while the Hits tab's focus had not landed yet.
        terminal.press("F7", "F2", "Enter")
        # The Tensor tab (the hit's detail on the Hits tab shows the same statistics)
        terminal.wait_for("compared with the previous step", "tensor[16,31,64] float32",
                          "NaN×1984", timeout=120)  # fmt: skip
        # The sequence that was all padding, typed in one go: "[" opens the slice box and the
        # rest is text in it (once, "3" became a count prefix).
        terminal.press("[3]", "Enter")
        terminal.wait_for("tensor[31,64] float32 n=1984 NaN×1984!")
        terminal.press("F5")
        # The line inside the attention's forward: the softmax that made the NaN.
        terminal.wait_for(
            "produced by blocks.0.attn", "→ 53         weights = F.softmax(scores, dim=-1)",
            "made by torch.nn.functional.softmax",
        )  # fmt: skip
        terminal.press("q")  # quit: the demo's training stops there and prints its summary
        terminal.wait_for("1 at their origin", "step 25 forward: [NaN] blocks.0.attn.output")
    finally:
        terminal.close()


@pytest.mark.timeout(300)
def test_q_in_the_demo_gives_the_terminal_back_at_once():
    """The demo's training would run for minutes: q stops it and the prompt is back at once,
    saying so, rather than after the training's end."""
    terminal = Terminal(f"{sys.executable} -m tensordbg.cli demo --steps 100000 --bad-step 99999")
    try:
        terminal.wait_for("RUNNING", "Run F1", timeout=120)
        terminal.press("q")
        quit_at = time.monotonic()
        terminal.wait_for("the UI quit: the demo's training stops here",
                          "the training's output, its end:", timeout=30)  # fmt: skip
        assert time.monotonic() - quit_at < 8  # under load; about 1.5 s on a quiet machine
    finally:
        terminal.close()


@pytest.mark.timeout(300)
def test_q_at_the_hit_stops_the_demo_at_that_step_and_says_so(tmp_path: Path):
    """q at the demo's hit: the person quit the demo, so its training stops at the hit's step,
    rather than running on unwatched until its loss had been NaN for three steps. The closing
    lines say it once: the UI's q detached the training, which printed "detached: the training
    goes on unwatched" just above the demo's line saying that it stops."""
    # A temporary directory of its own (set in the command itself, whatever environment tmux
    # passes on), so that no other run's log can come or go in it meanwhile.
    terminal = Terminal(f"TMPDIR={tmp_path} {sys.executable} -m tensordbg.cli demo --bad-step 3")
    try:
        terminal.wait_for("PAUSED", "● origin", timeout=120)
        assert list(tmp_path.glob("tensordbg-demo-*.log"))  # its log is in that directory
        terminal.press("q")
        screen = terminal.wait_for("the training's output, its end:", timeout=30)
        assert "step   3  the UI quit: the demo's training stops here" in screen
        assert "detached" not in screen and screen.count("unwatched") == 1
        assert "NaN for 3 steps" not in screen
    finally:
        terminal.close()
    # Its end was shown: the demo leaves no log behind.
    assert not list(tmp_path.glob("tensordbg-demo-*.log"))


@pytest.mark.timeout(300)
def test_f5_then_f4_at_the_hit_stay_on_the_tab_asked_for_at_80_by_24():
    """F5 at the hit (no tensor open yet) opened the hit's tensor and focused its values in
    the hidden Tensor tab; from F4 on, the two tabs took the focus from each other twice a
    second, at 100 % CPU, and the keys went to whichever tab was showing."""
    terminal = Terminal(f"{sys.executable} -m tensordbg.cli demo --bad-step 3", 80, 24)
    try:
        terminal.wait_for("PAUSED", "● origin", timeout=120)
        terminal.press("F5")
        terminal.wait_for("produced by blocks.0.attn")
        time.sleep(1.5)
        terminal.press("F4")
        terminal.wait_for("tensor[16,31,64] float32")

        def under_tensor_tab() -> bool:
            """Whether the tab bar's bright underline (between ╸ and ╺) is under "Tensor F4"."""
            time.sleep(0.3)
            lines = terminal.screen().splitlines()
            if len(lines) < 3 or "Tensor F4" not in lines[1]:
                return False
            label, bar = lines[1].index("Tensor F4"), lines[2]
            start, end = bar.find("╸") + 1, bar.find("╺", bar.find("╸") + 1)
            return start <= label and label + len("Tensor F4") <= (end if end > 0 else len(bar))

        # Its move to the tab asked for is animated, and a loaded machine draws it slowly (CI
        # once read two equal frames mid-move): wait until it is under the Tensor tab, then it
        # stays there (the flapping moved it to the other tab every half second).
        deadline = time.monotonic() + 30
        while not under_tensor_tab():
            assert time.monotonic() < deadline, terminal.screen()
        assert all(under_tensor_tab() for _ in range(10)), terminal.screen()
        assert "slice, e.g." in terminal.screen()  # still the Tensor tab
    finally:
        terminal.close()
