"""A banner across the top that says the connection is being made, could not be made, was lost,
or that the training is over; a replay's says which recorded step is shown."""

from __future__ import annotations

from textual.widgets import Static

KEPT = "The last state stays on screen."
DETACHED_BY = "by a UI's q or by session.detach() in the script"
"""What detaches tensordbg from a training, when the training does not say."""


class ConnectionBanner(Static):
    """Hidden while connected; ``show(text, kind)`` with kind ``connecting``, ``lost`` or
    ``replay``. The sentences of the connection's ups and downs are made here; each returns
    the text shown, for the Log tab."""

    def __init__(self) -> None:
        super().__init__("", id="connection-banner")
        self.lost = ""
        """The sentence shown while the connection is down ("" while it is up)."""
        self._failed = False  # an attempt to connect failed, and none succeeded since

    def show(self, text: str, kind: str = "lost") -> None:
        self.update(text)
        self.set_classes(f"-visible -{kind}")

    def clear(self) -> None:
        """Connected: nothing to say."""
        self.lost, self._failed = "", False
        self.update("")
        self.set_classes("")

    def connecting(self) -> None:
        """An attempt to connect begins. The failure of the last one stays (it said why, and
        "Connecting…" replaced it a second after it came, for the seconds the next one took)."""
        if not self.lost and not self._failed:
            self.show("Connecting to the training…", "connecting")

    def connect_failed(self, error: str) -> str:
        """An attempt to (re)connect failed; another follows."""
        self._failed = True
        if self.lost:
            self.show(f"{self.lost} Last attempt: {error}", "lost")
        else:
            self.show(f"Cannot connect yet: {_sentence(error)} Trying again…", "connecting")
        return f"cannot connect: {error}"

    def connection_lost(self, reason: str, reconnecting: bool) -> str:
        """The connection to a training that did not say it ended dropped."""
        then = " Reconnecting in the background…" if reconnecting else ""
        self.lost = f"Connection lost ({reason}): the training finished or crashed. {KEPT}{then}"
        self.show(self.lost, "lost")
        return self.lost

    def over(self, state: str, where: str, why: str = "") -> str:
        """The training said it ended (``state``: finished or detached, ``where``: at which
        step, ``why``: how, when it said) and its session closed the connection: there is
        nothing to reconnect to."""
        if state == "detached":
            what = (f"tensordbg was detached {where} ({why or DETACHED_BY}): the training goes "
                    "on, unwatched, and this UI no longer reaches it.")  # fmt: skip
        else:
            what = f"The training has {state} {where}{f': {why}' if why else ''}."
        self.lost = f"{what} {KEPT} Press q to quit."
        self.show(self.lost, "lost")
        return self.lost

    def exited(self, reason: str) -> str:
        """The training's process or session is gone (``reason`` says so): no more attempts."""
        kept = f" {KEPT}" if self.lost else ""
        self.lost = f"{reason[:1].upper()}{reason[1:]}.{kept} Press q to quit."
        self.show(self.lost, "lost")
        return self.lost


def _sentence(text: str) -> str:
    """``text`` ended as a sentence ("... is the training still running?" stays as it is)."""
    return text if text.endswith((".", "?", "!")) else f"{text}."
