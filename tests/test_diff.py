"""``tensordbg diff``: the first tensor, in execution order, where two dumped runs part."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from dumps import write_dump

from tensordbg.cli import main
from tensordbg.dump import load
from tensordbg.offline.diff import diff_dumps
from tensordbg.statistics import FINITE, MEAN


def test_two_identical_seeded_runs_agree(tmp_path: Path) -> None:
    a, b = write_dump(tmp_path / "a"), write_dump(tmp_path / "b")
    report = diff_dumps(load(a), load(b))
    assert report.first is None and report.exit_code == 0
    assert (report.steps, report.tensors, report.values) == (6, 54, 54)


def test_tensors_recorded_in_one_dump_only_are_said_why_and_are_no_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs whose numbers agree, one checked in batched mode (it records each weight's
    update) and one deferred (it records them only after a hit): the diff does not call the
    updates a difference, and says why one dump holds them."""
    a = write_dump(tmp_path / "a", values=False)
    b = write_dump(tmp_path / "b", values=False, sync="batched", updates_at=range(6))
    report = diff_dumps(load(a), load(b))
    assert report.first is None and report.exit_code == 0
    assert report.unpaired[0]["tensors"] == ["net.0.weight.update", "net.2.weight.update"]
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The runs agree on the tensors both recorded: 54 tensors of 6 steps")
    assert "net.0.weight.update at step 0 only in B and 11 more" in out
    assert "A was recorded with sync=deferred, B with sync=batched" in out
    # The same mode: the step after a hit records them (deferred), and the diff says so.
    after_hit = write_dump(tmp_path / "c", values=False, updates_at=[4])
    report = diff_dumps(load(after_hit), load(a))
    assert report.exit_code == 0 and report.unpaired[0]["side"] == "A"
    assert report.unpaired[0]["why"].startswith("A step with a hit, or the step after one")
    # A clean step of the same mode: an update is recorded only where it was measured.
    measured = write_dump(tmp_path / "d", values=False, nan_at=None, updates_at=[1])
    clean = write_dump(tmp_path / "e", values=False, nan_at=None)
    report = diff_dumps(load(measured), load(clean))
    assert report.exit_code == 0 and report.unpaired[0]["step"] == 1
    assert report.unpaired[0]["why"].startswith("An update is recorded only where it was measured")


def test_a_planted_one_element_change_is_found_at_its_tensor_and_step(tmp_path: Path) -> None:
    a = write_dump(tmp_path / "a", nan_at=None)
    b = write_dump(tmp_path / "b", nan_at=None, change=(4, "net.0.weight.grad", (7, 3), 1e-3))
    report = diff_dumps(load(a), load(b))
    first = report.first
    assert (first.step, first.tensor, first.phase) == (4, "net.0.weight.grad", "backward")
    assert first.values.elements == 1 and first.values.first_index == [7, 3]
    assert first.values.b - first.values.a == pytest.approx(1e-3, rel=1e-3)
    assert report.exit_code == 1


def test_statistics_alone_find_the_change_when_no_values_were_dumped(tmp_path: Path) -> None:
    a = write_dump(tmp_path / "a", values=False)
    b = write_dump(tmp_path / "b", values=False, change=(2, "net.1.output", (0, 0), 5.0))
    report = diff_dumps(load(a), load(b))
    assert (report.first.step, report.first.tensor, report.first.what) == (
        2, "net.1.output", "statistics")  # fmt: skip
    assert {"max", "l2"} <= {s.stat for s in report.first.stats} and report.values == 0
    assert "step 2, forward, net.1.output: " in report.text()


def test_where_one_run_made_a_nan_the_sentence_says_so_in_words(tmp_path: Path) -> None:
    """The same script with its NaN at step 3 in one run and step 5 in the other: the runs part
    at step 3, said as a person would ("NaN in A (1 of 32 elements), finite in B"), not as the
    statistics are named ("finite 0 in A, 1 in B; min nan in A, ...")."""
    a = write_dump(tmp_path / "a", nan_at=3, values=False)
    b = write_dump(tmp_path / "b", nan_at=5, values=False)
    report = diff_dumps(load(a), load(b))
    assert report.first.sentence() == (
        "step 3, forward, net.2.output: NaN in A (1 of 32 elements), finite in B"
    )
    assert {s.stat for s in report.first.stats} >= {"finite", "nan", "min"}  # the JSON's names
    # With the values: the first that differs is a NaN, no difference to measure.
    c, d = write_dump(tmp_path / "c", nan_at=3), write_dump(tmp_path / "d", nan_at=5)
    said = diff_dumps(load(c), load(d)).first.sentence()
    assert said.startswith(
        "step 3, forward, net.2.output: NaN in A (1 of 32 elements), finite in B; 1 of 32 "
        "values differ, the first at [1, 2]: NaN in A, "
    )
    assert "largest difference" not in said
    # Nor is it 0 in the JSON ("max_abs_diff": 0.0 read as "they agree"): NaN, said "nan".
    assert math.isnan(diff_dumps(load(c), load(d)).first.values.max_abs_diff)
    # A dump that holds only whether each tensor is finite, and its mean.
    e = write_dump(tmp_path / "e", nan_at=3, values=False, stats=(FINITE, MEAN))
    f = write_dump(tmp_path / "f", nan_at=5, values=False, stats=(FINITE, MEAN))
    said = diff_dumps(load(e), load(f)).first.sentence()
    assert said == "step 3, forward, net.2.output: not finite in A, finite in B"
    # Other statistics by what they are, not by their names in the index.
    g = write_dump(tmp_path / "g", values=False, change=(2, "net.1.output", (0, 0), 5.0))
    said = diff_dumps(load(a), load(g)).first.sentence()
    assert said.startswith("step 2, forward, net.1.output: maximum 2.84777 in A, 5 in B; mean ")
    assert "mean magnitude" in said and "L2 norm" in said and "abs_mean" not in said


def test_values_find_what_statistics_cannot_see(tmp_path: Path) -> None:
    """Two elements swapped: every statistic is the same, the values are not."""
    a = write_dump(tmp_path / "a", nan_at=None)
    rows = load(a).tensor("input[0]").value(1)
    delta = float(rows[0, 1]) - float(rows[0, 0])
    b = tmp_path / "b"
    write_dump(b, nan_at=None, change=(1, "input[0]", (0, 0), delta))
    report = diff_dumps(load(a), load(b), rtol=1e-3)
    assert report.first is not None and report.first.tensor == "input[0]"
    # Statistics only, the tiny shift hides within the tolerance.
    c, d = write_dump(tmp_path / "c", values=False), tmp_path / "d"
    write_dump(d, values=False, change=(1, "input[0]", (0, 0), 1e-7))
    assert diff_dumps(load(c), load(d)).first is None


def test_the_command_exits_0_1_2_and_speaks_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(write_dump(tmp_path / "a")), str(write_dump(tmp_path / "b"))
    c = str(write_dump(tmp_path / "c", change=(0, "loss", (), 0.5)))
    assert main(["diff", a, b]) == 0
    assert capsys.readouterr().out.startswith("The runs agree: 54 tensors of 6 steps")
    assert main(["diff", a, c, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["agree"] is False and report["first"]["tensor"] == "loss"
    assert report["first"]["step"] == 0 and "sentence" in report["first"]
    assert main(["diff", a, c, "--atol", "1"]) == 0  # within tolerance
    capsys.readouterr()
    assert main(["diff", a, str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["diff", a, b, "--ranks", "0,1"]) == 2
    assert "has no rank 1" in capsys.readouterr().err


def test_a_step_or_a_value_one_dump_cannot_read_is_named_so_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A damaged index line is not "dumped only in the other run", and a damaged values file
    is not a traceback: both are named, the rest is compared, and the exit status says that
    not everything could be read."""
    a = write_dump(tmp_path / "a")
    b = write_dump(tmp_path / "b")
    index = b / "rank-0" / "index.jsonl"
    lines = index.read_bytes().splitlines(keepends=True)
    step_line = next(i for i, line in enumerate(lines) if b'"step":2,' in line)
    lines[step_line] = lines[step_line].replace(b'"nbytes":', b'"nbytez":', 1)  # its CRC fails
    index.write_bytes(b"".join(lines))
    report = diff_dumps(load(a), load(b))
    assert report.only_in_a == [] and report.first is None and report.exit_code == 2
    assert [(x["step"], x["side"]) for x in report.broken] == [(2, "B")]
    assert "Not compared, unreadable in B: " in report.text()

    c = write_dump(tmp_path / "c")
    values = next((c / "rank-0").glob("step-*.safetensors"))
    data = bytearray(values.read_bytes())
    data[-3] ^= 0xFF  # a value's bytes: its checksum fails when it is read
    values.write_bytes(bytes(data))
    assert main(["diff", str(a), str(c)]) == 2
    out = capsys.readouterr().out
    assert "Not compared, unreadable in B: " in out and "Traceback" not in out


def test_an_index_that_cannot_be_read_leaves_its_steps_unknown_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """B's index cut short: which steps B holds is not known, so A's steps are not "dumped
    only in A" and nothing says the runs differ; the diff names B's index and what is wrong."""
    a, b = write_dump(tmp_path / "a"), write_dump(tmp_path / "b")
    index = b / "rank-0" / "index.jsonl"
    index.write_bytes(index.read_bytes()[:100])
    report = diff_dumps(load(a), load(b))
    assert report.only_in_a == [] and report.steps == 0 and report.exit_code == 2
    assert main(["diff", str(a), str(b)]) == 2
    out = capsys.readouterr().out
    assert "only in A" not in out and "no readable step in common" not in out
    assert f"The index of B cannot be read whole, so which steps it holds is not known: {index} " \
           "is cut short (100 of" in out  # fmt: skip


def test_a_step_one_dump_cannot_read_is_said_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = write_dump(tmp_path / "a"), write_dump(tmp_path / "b")
    step_file = b / "rank-0" / "step-00000004.safetensors"
    step_file.write_bytes(step_file.read_bytes()[:100])
    assert main(["diff", str(a), str(b)]) == 2
    out = capsys.readouterr().out
    assert out.count(f"Not compared, unreadable in B: {step_file} is truncated") == 1
    assert out.startswith("The runs agree on what could be read (45 tensors of 5 steps)")


def test_a_values_file_whose_values_cannot_be_read_is_listed_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A byte of B's step 4 flipped in its first value: that value fails its checksum, and
    each value of the step read after it fails with the same sentence. The step is listed once
    as unreadable in B, in the text and in the JSON, not once per value."""
    a, b = write_dump(tmp_path / "a"), write_dump(tmp_path / "b")
    step_file = b / "rank-0" / "step-00000004.safetensors"
    data = bytearray(step_file.read_bytes())
    data[8 + int.from_bytes(data[:8], "little")] ^= 0xFF  # the first byte after the header
    step_file.write_bytes(bytes(data))
    reason = f"{step_file} fails its checksum at input[0]: its bytes changed after writing"
    assert main(["diff", str(a), str(b)]) == 2
    out = capsys.readouterr().out
    assert out.count("Not compared, unreadable in B: ") == 1
    assert f"Not compared, unreadable in B: {reason}" in out
    assert main(["diff", str(a), str(b), "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["broken"] == [{"step": 4, "side": "B", "reason": reason}]


def test_the_parting_step_says_what_later_differences_count_and_which_steps_were_unseen(
    tmp_path: Path,
) -> None:
    """Past the first difference only statistics are compared: the count says so. When steps
    before it were not dumped (one step in two), the runs may have parted in one of them."""
    a = write_dump(tmp_path / "a", steps=[0, 2, 4], nan_at=None)
    b = write_dump(tmp_path / "b", steps=[0, 2, 4], nan_at=None,
                   change=(4, "net.1.output", (0, 0), 5.0))  # fmt: skip
    report = diff_dumps(load(a), load(b))
    assert report.first.step == 4 and report.not_compared_before == [3]
    assert "net.1.output: " in report.text()
    assert "(step 3 was not dumped: the runs may have parted there)." in report.text()
    assert report.as_json()["not_compared_before"] == [3]
    report.later = 13
    assert "After it, 13 more tensors differ in their statistics." in report.text()
    report.later = 1
    assert "After it, 1 more tensor differs in its statistics." in report.text()
    at_start = diff_dumps(load(a), load(write_dump(tmp_path / "c", steps=[0, 2, 4], nan_at=None,
                          change=(0, "loss", (), 1.0))))  # fmt: skip
    assert at_start.first.step == 0 and at_start.not_compared_before == []
    assert "may have parted" not in at_start.text()


def test_a_tensor_only_one_run_made_is_where_they_part_when_it_is_not_finite(tmp_path):
    """A module that passes its input on unchanged makes no tensor of its own in a clean run;
    in the run where it made a NaN, its output is a new tensor. That is where the runs part,
    not the first tensor after it that both hold."""
    from tensordbg.dump.writer import DumpWriter

    def entry(name: str, finite: float) -> dict:
        return {"name": name, "module": name.split(".")[0], "phase": "forward", "kind": "output",
                "shape": [4], "dtype": "float32", "stats": {"finite": finite}}  # fmt: skip

    for name, entries in (("a", [entry("0.output", 1.0), entry("2.output", 1.0)]),
                          ("b", [entry("0.output", 1.0), entry("1.output", 0.0),
                                 entry("2.output", 0.0)])):  # fmt: skip
        writer = DumpWriter(tmp_path / name, {})
        writer.write_step(0, 0, entries, {}, [])
        writer.close()
    report = diff_dumps(load(tmp_path / "a"), load(tmp_path / "b"))
    assert (report.first.tensor, report.first.what) == ("1.output", "only in b")
    assert report.first.sentence() == (
        "step 0, forward, 1.output: dumped only in B, where it is not finite"
    )
    assert report.later == 1 and report.exit_code == 1


@pytest.mark.parametrize("bad", [["--rtol", "-1"], ["--atol", "nan"], ["--rtol", "inf"]])
def test_a_tolerance_that_is_no_tolerance_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str]
) -> None:
    a, b = write_dump(tmp_path / "a"), write_dump(tmp_path / "b")
    with pytest.raises(SystemExit) as exit:
        main(["diff", str(a), str(b), *bad])
    assert exit.value.code == 2
    assert f"{bad[1]!r}: a tolerance is a finite number, 0 or more" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [{"rtol": -1.0}, {"atol": math.nan}, {"rtol": math.inf}])
def test_the_library_refuses_a_tolerance_that_is_no_tolerance_too(tmp_path: Path, bad) -> None:
    """``diff_dumps`` itself refuses it (the command line says so through it): a negative or
    NaN tolerance would report agreement whatever the values."""
    a, b = write_dump(tmp_path / "a"), write_dump(tmp_path / "b")
    with pytest.raises(ValueError, match="a tolerance is a finite number, 0 or more"):
        diff_dumps(load(a), load(b), **bad)


def test_the_diff_says_where_the_run_that_hit_named_its_origin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model's own code between two modules made the NaN: a dump under deferred checks
    holds no statistics of that value, so the first difference is the next module's output,
    and the diff named only that. It now adds where B's session, live, said the value was made."""
    import torch
    from torch import nn

    import tensordbg
    from tensordbg.rules import NaN

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
            self.broken = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(torch.log(h - 100) if self.broken else h)

    for run, bad_step in (("a", None), ("b", 2)):
        model = Model()
        session = tensordbg.attach(model, on_hit="record", rules=[NaN()], server=False,
                                   dump_dir=tmp_path / run, dump_every=1, sync="deferred",
                                   summary_at_exit=False)  # fmt: skip
        torch.manual_seed(1)
        with torch.no_grad():
            for step in range(4):
                model.broken = step == bad_step
                model(torch.randn(3, 4))
        session.detach()
    report = diff_dumps(load(tmp_path / "a"), load(tmp_path / "b"))
    assert (report.first.step, report.first.tensor) == (2, "b.output")
    [origin] = report.origins
    assert (origin["side"], origin["rule"], origin["tensor"]) == ("B", "NaN", "output")
    assert "the model's own forward code between its submodules" in origin["message"]
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    said = capsys.readouterr().out.splitlines()
    assert said[1].startswith("B named an origin at that step, live: [NaN] output (forward): ")


def test_a_loss_observed_at_each_micro_batch_is_compared_micro_batch_by_micro_batch(
    tmp_path: Path,
) -> None:
    """Gradient accumulation observes the loss four times a step (``loss``, ``loss#1``, ...;
    dumps made before that numbering hold four ``loss``, paired k-th with k-th): two runs that
    agree agree on each of the four (the diff paired the first of one run with the last of the
    other, and said two identical runs parted at step 0's loss); the run whose second
    micro-batch of step 2 is poisoned parts there."""
    import torch
    from torch import nn

    import tensordbg
    from tensordbg.rules import NaN, Overflow

    for run, bad_step in (("a", None), ("b", None), ("c", 2)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        session = tensordbg.attach(model, optimizer=optimizer, on_hit="record", server=False,
                                   rules=[NaN(), Overflow()], dump_dir=tmp_path / run,
                                   dump_every=1, summary_at_exit=False)  # fmt: skip
        x = torch.randn(4, 16, 4)
        for step in range(3):
            for micro in range(4):
                batch = x[micro].clone()
                if step == bad_step and micro == 1:
                    batch[0, 0] = float("inf")
                loss = model(batch).square().mean() / 4
                session.observe("loss", loss)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        session.detach()
    a, b, c = (load(tmp_path / run) for run in "abc")
    assert [e.name for e in a.tensors(0) if e.kind == "observed"] == [
        "loss", "loss#1", "loss#2", "loss#3"
    ]  # fmt: skip
    report = diff_dumps(a, b)
    assert report.first is None and report.exit_code == 0
    assert report.tensors == diff_dumps(a, a).tensors
    report = diff_dumps(a, c)
    assert (report.first.step, report.first.tensor) == (2, "#1.input[0]")


def test_steps_not_dumped_are_not_said_where_the_runs_may_have_parted_after_a_whole_forward_agreed(
    tmp_path: Path,
) -> None:
    """Step 4's forward and backward compared and agreed, its update did not: the runs
    entered step 4 alike, so they did not part in step 3 (not dumped). The diff said they
    may have."""
    a = write_dump(tmp_path / "a", steps=[0, 2, 4], nan_at=None)
    b = write_dump(tmp_path / "b", steps=[0, 2, 4], nan_at=None,
                   change=(4, "net.0.weight", (0, 0), 5.0))  # fmt: skip
    report = diff_dumps(load(a), load(b))
    assert (report.first.step, report.first.phase) == (4, "optimizer")
    assert report.not_compared_before == [] and "may have parted" not in report.text()


def test_an_index_line_whose_step_number_changed_is_not_read_as_that_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ "step":2 changed to "step":3 on B's line: the diff listed step 2 as dumped only in A,
    trusting a line that fails its checksum for its step."""
    a, b = write_dump(tmp_path / "a"), write_dump(tmp_path / "b")
    index = b / "rank-0" / "index.jsonl"
    lines = index.read_bytes().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if b'"step":2,' in line)
    lines[at] = lines[at].replace(b'"step":2,', b'"step":3,', 1)
    index.write_bytes(b"".join(lines))
    report = diff_dumps(load(a), load(b))
    assert report.only_in_a == [] and report.exit_code == 2
    assert main(["diff", str(a), str(b)]) == 2
    out = capsys.readouterr().out
    assert "dumped only" not in out
    assert (f"The index of B cannot be read whole, so which steps it holds is not known: {index} "
            f"line {at + 1} was altered (the line fails its checksum): which step it listed "
            "cannot be told (it reads as step 3)") in out  # fmt: skip


def test_a_hit_at_a_step_the_other_run_went_past_without_one_is_a_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN run against a clean one that dumped every few steps exited 0 with "agree": true:
    the NaN step was dumped in the NaN run only. A step with a hit is always dumped, so the
    clean run went past it without one: the runs differ (1). A hit after the other run's last
    dumped step cannot be told so: it leads the text, and the status stays 0."""
    a = write_dump(tmp_path / "a", steps=[0, 1, 2, 5], nan_at=None)
    b = write_dump(tmp_path / "b", steps=[0, 1, 2, 3], nan_at=3)
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out.splitlines()
    said = "B hit here, A went on past this step without a hit (a step with a hit is always dumped)"
    assert out[0] == f"The runs part at step 3, forward, net.2.output: {said}.", out
    assert main(["diff", "--json", str(a), str(b)]) == 1
    assert json.loads(capsys.readouterr().out)["agree"] is False
    c = write_dump(tmp_path / "c", steps=[0, 1, 2], nan_at=None)
    assert main(["diff", str(c), str(b)]) == 0


def test_an_index_line_altered_to_fewer_bytes_is_not_said_to_cut_the_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line overwritten with shorter garbage: "index.jsonl is cut short ...: the steps after
    its last line are missing", though they were there and compared."""
    a, b = write_dump(tmp_path / "a"), write_dump(tmp_path / "b")
    index = b / "rank-0" / "index.jsonl"
    lines = index.read_bytes().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if b'"step":2,' in line)
    lines[at] = b'{"crc":"68 garbage###' + lines[at][40:]
    index.write_bytes(b"".join(lines))
    assert main(["diff", str(a), str(b)]) == 2
    out = capsys.readouterr().out
    assert "cut short" not in out and "dumped only" not in out
    assert f"Not compared, unreadable in B: {index} line {at + 1}: the line has no checksum" in out
    assert "(45 tensors of 5 steps)" in out  # the steps after it compared


def test_steps_one_run_dumped_alone_lead_the_text_with_their_hits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A clean run against one that hit NaN at steps it alone dumped read "The runs agree",
    the steps only in B last. The text leads with B's hits and what was not compared; the
    exit status stays 0, as for any step dumped in one run only (not compared)."""
    a = write_dump(tmp_path / "a", steps=[0, 1, 2], nan_at=None)
    b = write_dump(tmp_path / "b", steps=[0, 1, 2, 3, 4], nan_at=3)
    assert main(["diff", str(a), str(b)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "B hit at step 3, which only B dumped (the first at its origin: [NaN] net.2.output, "
        "forward of step 3); step 4 too, without hits: not compared, A's dump ends at step 2.",
        "On the 3 steps both dumped, the runs agree: 27 tensors within rtol=1e-05, atol=1e-08 "
        "(27 compared by value).",
    ]
    # Steps the other run went past without dumping them are said so.
    c = write_dump(tmp_path / "c", steps=[0, 1, 3], nan_at=None)
    d = write_dump(tmp_path / "d", steps=[0, 2, 3], nan_at=None)
    assert main(["diff", str(c), str(d)]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == [
        "Step 1 dumped only in A: not compared, B's run went on past it (it dumped step 3) "
        "without dumping it.",
        "Step 2 dumped only in B: not compared, A's run went on past it (it dumped step 3) "
        "without dumping it.",
    ]


def test_a_tensor_all_nan_in_one_run_is_compared_without_a_numpy_warning() -> None:
    """Every element of a tensor NaN in B, finite in A: numpy's "All-NaN slice encountered",
    with its source line, reached the person's terminal twice."""
    import warnings

    import numpy as np

    from tensordbg.offline.diff import DiffReport, _compare_values

    report = DiffReport(a="a", b="b", ranks=(0, 0), rtol=1e-5, atol=1e-8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = _compare_values(np.ones((4, 3)), np.full((4, 3), np.nan), report)
    assert found is not None and found.elements == 12 and math.isnan(found.max_abs_diff)


def test_the_runs_part_at_the_hit_the_other_run_went_past_not_at_a_later_compared_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A clean run dumped every 5 steps against one that hit at step 3 and differs at step 5
    too: "The runs part at step 5 ... (steps 3 and 4 were not compared: the runs may have parted
    there)", and ``first.step`` 5, though step 3's hit is a known difference."""
    a = write_dump(tmp_path / "a", steps=[0, 5, 6], nan_at=None)
    b = write_dump(tmp_path / "b", steps=[0, 3, 5, 6], nan_at=3,
                   change=(5, "net.2.output", (0, 0), 1.0))  # fmt: skip
    assert main(["diff", "--json", str(a), str(b)]) == 1
    first = json.loads(capsys.readouterr().out)["first"]
    assert (first["step"], first["tensor"], first["what"]) == (3, "net.2.output", "hit only in b")
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("The runs part at step 3, forward, net.2.output: B hit here")
    assert "(steps 1 and 2 were not dumped: the runs may have parted there)" in out


def test_a_dump_whose_bound_took_steps_with_hits_is_not_said_to_have_gone_past_without_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With max_bytes, steps with hits can go: "B went on past it without a hit (a step with a
    hit is always dumped)" was said of a run that hit there as the other did."""
    a = write_dump(tmp_path / "a", steps=[0, 1, 2, 5], nan_at=None)
    meta_path = a / "rank-0" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "evicted_hit_steps": [[3, 0]]}))
    b = write_dump(tmp_path / "b", steps=[0, 1, 2, 3], nan_at=3)
    main(["diff", str(a), str(b)])
    assert "without a hit" not in capsys.readouterr().out


@pytest.mark.parametrize("every", [8, None], ids=["every-8", "hits-only"])
def test_a_clean_run_that_trained_past_the_other_runs_nan_is_a_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], every: int | None
) -> None:
    """Two 24-step runs, B's batch NaN at step 20: A dumped steps 0, 8 and 16 (or none: hits
    only), and the diff said "the runs agree" (or "nothing to compare"), exit 0, for A's dump
    ended at step 16: nothing said that A trained on to step 23 (found trying the product as a
    new user). The dump now says which steps its run went through."""
    import torch
    from torch import nn

    import tensordbg

    for run, bad_step in (("a", None), ("b", 20)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        session = tensordbg.attach(model, opt, on_hit="record", server=False,
                                   dump_dir=tmp_path / run, dump_every=every,
                                   summary_at_exit=False)  # fmt: skip
        for step in range(24):
            x = torch.randn(8, 4)
            if step == bad_step:
                x[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        session.detach()
    assert load(tmp_path / "a").meta["last_step_run"] == 23
    report = diff_dumps(load(tmp_path / "a"), load(tmp_path / "b"))
    assert (report.first.step, report.first.what) == (20, "hit only in b")
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    said = capsys.readouterr().out
    assert "A went on past this step without a hit" in said
