"""``tensordbg check``: the rules judged again on a dump, as a linter: the same verdicts as the
live training, a rule that cannot judge says so, exit 0 / 1 / 2, a table or JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dumps import STATS, step_tensors, write_dump
from torch import nn

import tensordbg
from tensordbg.cli import main
from tensordbg.dump import load
from tensordbg.dump.writer import NOT_FINISHED, DumpWriter
from tensordbg.offline.check import check_dump
from tensordbg.offline.values import parse_stat
from tensordbg.rules import DeadActivation, NaN, TensorRange, VanishingGradient
from tensordbg.statistics import MAX, MIN, compute_numpy, in_range_frac


def test_a_planted_nan_is_found_where_it_was_made_and_where_it_went(tmp_path: Path) -> None:
    report = check_dump(load(write_dump(tmp_path / "run", nan_at=3)))
    found = [(f.step, f.rule, f.tensor) for f in report.findings]
    assert found == [(3, "NaN", "net.2.output"), (3, "NaN", "loss")]  # in execution order
    assert report.exit_code == 1 and report.steps == 6 and report.tensors == 54
    assert report.unjudged == []
    clean = check_dump(load(write_dump(tmp_path / "clean", nan_at=None)))
    assert clean.findings == [] and clean.exit_code == 0


def test_a_dump_of_the_hit_steps_only_says_that_history_rules_saw_only_those() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        report = check_dump(load(write_dump(Path(tmp) / "run", steps=[3, 4, 5])))
    assert any("3 of steps 0-5 were not dumped (the dump holds only the steps with hits)" in note
               for note in report.notes)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        every = check_dump(load(write_dump(Path(tmp) / "run")))
    assert not any("were not dumped" in note for note in every.notes)


def test_check_agrees_with_the_live_verdicts_of_the_same_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rules = [NaN(), TensorRange(match="2", kinds=["output"], max_gt=0.5)]
    session = tensordbg.attach(model, opt, rules=rules, on_hit="record", server=False,
                               sync="eager", dump_dir=tmp_path, dump_every=1,
                               summary_at_exit=False)  # fmt: skip
    torch.manual_seed(1)
    for step in range(6):
        x = torch.randn(16, 4) * (1 + step)
        if step == 4:
            x[3, 1] = float("nan")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    live = {(h.step, h.rule, h.tensor) for h in session.hits}
    session.detach()
    assert {rule for _, rule, _ in live} == {"NaN", "TensorRange"}  # both rules hit live

    report = check_dump(load(tmp_path))  # the rules the run was recorded with
    offline = {(f.step, f.rule, f.tensor) for f in report.findings}
    assert offline == live
    assert report.unjudged == []


def test_a_nan_layer_is_not_called_dead_live_nor_offline(tmp_path: Path) -> None:
    """A ReLU layer dead from the start (its bias far below 0), and at step 3 a batch of NaN:
    DeadActivation says the layer is dead at steps 0-2, live and offline alike, and nothing at
    step 3, where the layer holds NaN (the NaN rule's finding), not dead units."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, rules=[NaN(), DeadActivation()], on_hit="record",
                               server=False, dump_dir=tmp_path, dump_every=1,
                               summary_at_exit=False)  # fmt: skip
    for step in range(4):
        x = torch.randn(16, 4) if step < 3 else torch.full((16, 4), float("nan"))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    live = {(h.step, h.rule, h.tensor) for h in session.hits}
    session.detach()
    dead = {(step, "DeadActivation", "1.output") for step in range(3)}
    assert {h for h in live if h[1] == "DeadActivation"} == dead
    assert (3, "NaN", "1.output") in live
    report = check_dump(load(tmp_path))
    assert {(f.step, f.rule, f.tensor) for f in report.findings} == live


def test_a_statistic_the_dump_lacks_is_said_in_words(tmp_path: Path) -> None:
    """A run recorded without DeadActivation, its statistics only: check --rules DeadActivation
    cannot judge its ReLU's output, and says what it lacks as a person would, not as
    dead_unit_frac(0, inf, -1, 0.01)."""
    dump = load(write_dump(tmp_path / "run", values=False, nan_at=None))
    table = check_dump(dump, rules=[DeadActivation()]).table()
    assert (
        "DeadActivation could not judge 6 tensors: the dump holds neither their fraction of dead "
        "units (a run with DeadActivation on dumps it) nor their values to compute it from "
        "(first: net.1.output at step 0)"
    ) in table.splitlines()
    assert "dead_unit_frac" not in table


def test_a_dump_of_one_hit_step_judges_a_bias_cancelled_by_construction_as_the_run_did(
    tmp_path: Path,
) -> None:
    """A WGAN critic's loss, mean D(fake) - mean D(real), cancels its last bias exactly (its
    gradient is 0) while the weight learns. A dump of the hit step alone holds no earlier step
    to remember the weight by: its gradients are judged together, as the run judged them, and
    check says what the run said (no VanishingGradient)."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(critic.parameters(), lr=0.01)
    session = tensordbg.attach(critic, opt, on_hit="dump", server=False, dump_dir=tmp_path,
                               summary_at_exit=False)  # fmt: skip
    for step in range(4):
        fake = torch.randn(8, 6)
        if step == 3:
            fake[0, 0] = float("nan")  # the hit: only this step is dumped
        (critic(fake).mean() - critic(torch.randn(8, 6)).mean()).backward()
        opt.step()
        opt.zero_grad()
    live = sorted((h.step, h.rule, h.tensor) for h in session.hits)
    session.detach()
    report = check_dump(load(tmp_path))
    assert load(tmp_path).steps() == [3]
    assert not [f for f in report.findings if f.rule == "VanishingGradient"]
    assert sorted((f.step, f.rule, f.tensor) for f in report.findings) == live


def test_a_model_called_three_times_a_step_is_checked_as_the_run_saw_it(tmp_path: Path) -> None:
    """Two evaluation calls under no_grad, then the training call, each step: each call's
    tensors keep names of their own (the module's call number), so the dump holds all three
    and check finds what the run found, tensor by tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, rules=[NaN()], on_hit="record", server=False,
                               dump_dir=tmp_path, dump_every=1, summary_at_exit=False)  # fmt: skip
    for step in range(4):
        with torch.no_grad():
            model(torch.randn(16, 4))
            model(torch.randn(16, 4))
        x = torch.randn(16, 4)
        if step == 2:
            x[0, 0] = float("nan")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    live = sorted((h.step, h.rule, h.tensor) for h in session.hits)
    session.detach()
    assert (2, "NaN", "0#2.output") in live
    report = check_dump(load(tmp_path))
    assert sorted((f.step, f.rule, f.tensor) for f in report.findings) == live


def test_a_rule_that_needs_what_the_dump_lacks_says_so_instead_of_passing(tmp_path: Path) -> None:
    bare = load(write_dump(tmp_path / "bare", stats=(MIN, MAX), values=False, nan_at=None))
    report = check_dump(bare, rules=[VanishingGradient()])
    assert report.findings == [] and len(report.unjudged) == 1
    unjudged = report.unjudged[0]
    assert unjudged.rule == "VanishingGradient" and unjudged.tensors == 12  # 2 grads x 6 steps
    said = "VanishingGradient could not judge 12 tensors: the dump holds neither their L2 norm"
    assert said in report.table()
    # With the values dumped, the statistic is computed from them and the rule judges.
    full = load(write_dump(tmp_path / "full", stats=(MIN, MAX), values=True, nan_at=None))
    assert check_dump(full, rules=[VanishingGradient()]).unjudged == []


def test_dumped_statistic_names_read_back_as_the_rules_ask_for_them() -> None:
    assert parse_stat("l2") == STATS[8]
    assert parse_stat(str(in_range_frac(-1, 0.5))) == in_range_frac(-1, 0.5)
    assert parse_stat("numel") is None and parse_stat("in_range_frac(a, b)") is None


# --- the command ---------------------------------------------------------------------------


def test_the_command_exits_0_clean_1_on_a_hit_2_when_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", str(write_dump(tmp_path / "clean", nan_at=None))]) == 0
    assert "clean: NaN, Overflow, ExplodingGradient over 54 tensors" in capsys.readouterr().out
    hit = str(write_dump(tmp_path / "hit", nan_at=2))
    assert main(["check", hit]) == 1
    out = capsys.readouterr().out
    # The first finding is where the NaN arose, as the run's own hit said.
    assert out.splitlines()[0].split() == ["step", "2", "forward", "NaN", "net.2.output", "<-",
                                           "origin"]  # fmt: skip
    assert "it arose at net.2.output, step 2 (NaN)" in out
    assert main(["check", str(tmp_path)]) == 2  # the parent: not a dump
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a tensordbg dump" in err
    assert main(["check", hit, "--rules", "Overflow"]) == 0
    # --rules '' names no rule: a lint with nothing to judge would pass any dump (an empty CI
    # variable said "clean" of a dump full of NaN), so it is refused, in one sentence
    capsys.readouterr()
    assert main(["check", hit, "--rules", ""]) == 2
    assert "no rules to judge with" in capsys.readouterr().err
    assert main(["check", hit, "--rules", "", "--rule", "NaN()"]) == 1
    capsys.readouterr()
    bare = str(write_dump(tmp_path / "bare", stats=(MIN, MAX), values=False, nan_at=None))
    # VanishingGradient could judge none of its gradients: not a clean run (2), with --strict
    # too (it fails on any tensor a rule could not judge, and is never more lenient).
    assert main(["check", bare, "--rules", "VanishingGradient"]) == 2
    assert main(["check", bare, "--rules", "VanishingGradient", "--strict"]) == 2


def test_the_table_gives_each_advice_once_and_the_json_with_every_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Live, a NaN's advice (what it usually comes from) is given where it arose, not at every
    tensor it reached; the table repeated it under each finding, so a NaN that spread to 30
    tensors printed the same paragraph 30 times. Each finding says what it found, and each
    advice comes once after them; the JSON keeps it in each finding's message."""
    dump = str(write_dump(tmp_path / "run", nan_at=3))  # net.2.output, then the loss
    advice = "A NaN usually comes from 0/0"
    assert main(["check", dump]) == 1
    out = capsys.readouterr().out
    assert out.count(advice) == 1
    assert "    net.2.output holds 1 NaN among 32 values.\n" in out
    assert "    loss holds 1 NaN, its only value.\n" in out
    assert f"about the 2 NaN findings: {advice}" in out
    assert main(["check", dump, "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert len(findings) == 2 and all(advice in f["message"] for f in findings)
    assert findings[1]["message"].startswith("loss holds 1 NaN, its only value. A NaN usually")


def test_a_nan_gradient_is_one_row_naming_both_rules_that_found_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN parameter gradient fires NaN and ExplodingGradient with the same sentence: the
    table shows that fact once, naming both rules; the JSON keeps a finding per rule."""
    nan_grad = (3, "net.2.weight.grad", (0, 0), float("nan"))
    dump = str(write_dump(tmp_path / "run", nan_at=None, change=nan_grad))
    assert main(["check", dump]) == 1
    out = capsys.readouterr().out
    assert out.count("net.2.weight.grad holds 1 NaN among 128 values.") == 1
    row = next(line for line in out.splitlines() if line.startswith("step 3 backward"))
    assert "ExplodingGradient, NaN" in row and row.endswith("net.2.weight.grad")
    assert "2 findings (1 of them a second rule saying what another said)" in out
    assert main(["check", dump, "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert sorted(f["rule"] for f in findings) == ["ExplodingGradient", "NaN"]


def test_a_rule_given_with_arguments_takes_the_place_of_the_default_one_of_its_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--rule "NaN()"`` without ``--rules`` is the default set with that NaN, not a second NaN
    beside the default's: each NaN is found once. Two given rules of one class both apply."""
    nan_grad = (3, "net.2.weight.grad", (0, 0), float("nan"))
    dump = str(write_dump(tmp_path / "run", nan_at=None, change=nan_grad))
    assert main(["check", dump, "--json", "--rule", "NaN()"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert sorted(f["rule"] for f in report["findings"]) == ["ExplodingGradient", "NaN"]
    assert [r.split("(")[0] for r in report["rules"]].count("NaN") == 1
    assert main(["check", dump, "--json", "--rule", "ExplodingGradient(max_norm=1e-9)"]) == 1
    rules = json.loads(capsys.readouterr().out)["rules"]
    assert [r for r in rules if r.startswith("ExplodingGradient")] == [
        next(r for r in rules if "1e-09" in r)
    ]
    given = ["--rule", "TensorRange(match='net.0.*', max_gt=1e9)",
             "--rule", "TensorRange(match='net.2.*', max_gt=1e9)"]  # fmt: skip
    assert main(["check", dump, "--json", "--rules", "NaN", *given]) == 1
    rules = json.loads(capsys.readouterr().out)["rules"]
    assert [r.split("(")[0] for r in rules] == ["NaN", "TensorRange", "TensorRange"]


def test_the_json_report_follows_its_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = str(write_dump(tmp_path / "run", nan_at=3))
    assert main(["check", dump, "--json", "--rule", "TensorRange(max_gt=1e9)"]) == 1
    report = json.loads(capsys.readouterr().out)
    keys = "schema dump run_id rules ranks steps tensors complete clean findings unjudged"
    assert set(report) == {*keys.split(), "reason_incomplete", "nothing_judged", "broken", "notes",
                           "unchecked_rules"}  # fmt: skip
    assert report["schema"] == 1 and report["clean"] is False and report["run_id"] == "replay01"
    assert report["rules"][-1].startswith("TensorRange(")
    first = report["findings"][0]
    assert set(first) == {"step", "rank", "phase", "order", "tensor", "module", "kind", "rule",
                          "value", "threshold", "message", "origin", "stored_as"}  # fmt: skip
    assert (first["step"], first["tensor"], first["order"]) == (3, "net.2.output", 3)
    assert first["stored_as"] == "" and report["reason_incomplete"] is None


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path: Path) -> None:
    """``tensordbg check DIR --json | head`` printed a BrokenPipeError's traceback once head had
    what it wanted: it ends quietly, as other tools do (found trying the product as a new
    user)."""
    import subprocess
    import sys

    dump = str(write_dump(tmp_path / "run", nan_at=3))
    child = subprocess.Popen([sys.executable, "-m", "tensordbg.cli", "check", dump, "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # the reader is gone before the report is written
    err = child.stderr.read()
    assert child.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_the_tables_columns_stay_aligned_past_step_9(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every row from step 10 on was shifted one column right of step 9's."""
    dump = str(write_dump(tmp_path / "run", steps=range(8, 12), nan_at=None))
    assert main(["check", dump, "--rule", "TensorRange(max_gt=-1e9)"]) == 1
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert {line.split()[1] for line in rows} == {"8", "9", "10", "11"}
    assert len({line.index("forward") for line in rows if "forward" in line}) == 1, rows


def test_the_json_names_the_origin_as_the_run_and_the_table_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN made by the model's own forward code, between its submodules, is dumped as the
    last submodule's output, but the run named the model's forward (``output``, module ""):
    the table said so and the JSON named the submodule. Both name what the run named, the JSON
    with the name the tensor is dumped under in ``stored_as``."""
    dump = str(write_dump(tmp_path / "run", nan_at=3, named=("output", "")))
    assert main(["check", dump]) == 1
    out = capsys.readouterr().out
    assert "output (dumped as net.2.output)  <- origin\n    output holds 1 NaN among 32" in out
    assert "it arose at output (dumped as net.2.output), step 3 (NaN)" in out
    assert main(["check", dump, "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    origins = [f for f in findings if f["origin"]]
    assert [(f["tensor"], f["module"], f["stored_as"]) for f in origins] == [
        ("output", "", "net.2.output")
    ]
    assert origins[0]["message"].startswith("output holds 1 NaN among 32 values.")
    assert [(f["tensor"], f["stored_as"]) for f in findings if not f["origin"]] == [("loss", "")]
    # Named as the run named it, kind too (a consumer's grad_input, dumped as what made it).
    dump = str(write_dump(tmp_path / "grad", nan_at=3, named=("net.3.grad_input[0]", "net.3",
                                                             "grad_input")))  # fmt: skip
    assert main(["check", dump, "--json"]) == 1
    origins = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["origin"]]
    assert [(f["tensor"], f["kind"], f["stored_as"]) for f in origins] == [
        ("net.3.grad_input[0]", "grad_input", "net.2.output")
    ]


def _alter_index_line(dump: Path, step: int) -> tuple[Path, int]:
    """Change a dtype in the index line of ``step``: the line then fails its checksum. Returns
    the index and the line's number."""
    index = dump / "rank-0" / "index.jsonl"
    lines = index.read_bytes().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if f'"step":{step},'.encode() in line)
    lines[at] = lines[at].replace(b'"dtype":"float32"', b'"dtype":"float64"', 1)
    index.write_bytes(b"".join(lines))
    return index, at + 1


def test_a_broken_step_is_reported_and_the_others_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step whose index line fails its checksum is not checked; the others are."""
    dump = write_dump(tmp_path / "run", nan_at=3)
    index, line = _alter_index_line(dump, 3)
    report = check_dump(load(dump))
    assert report.steps == 5 and report.findings == []
    assert report.broken[0]["step"] == 3 and not report.broken[0]["statistics_checked"]
    assert main(["check", str(dump)]) == 2  # not clean: a CI job must not pass what was unread
    out = capsys.readouterr().out
    assert f"step 3 of rank 0 was not checked: {index} line {line}" in out
    assert out.splitlines()[-1].endswith("; not all of the dump could be read (see above)")
    assert "clean" not in out.splitlines()[-1]


def test_a_step_whose_values_file_is_cut_is_checked_on_the_statistics_of_its_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The index holds every tensor's statistics: a cut values file loses the values, not the
    step's NaN, which is still found where it arose."""
    dump = write_dump(tmp_path / "run", nan_at=3)
    step_file = dump / "rank-0" / "step-00000003.safetensors"
    step_file.write_bytes(step_file.read_bytes()[:1000])
    report = check_dump(load(dump))
    assert report.steps == 6 and {f.step for f in report.findings} == {3}
    assert [(f.tensor, f.step) for f in report.findings if f.origin] == [("net.2.output", 3)]
    assert report.broken[0]["step"] == 3 and report.broken[0]["statistics_checked"]
    assert main(["check", str(dump)]) == 1
    out = capsys.readouterr().out
    assert (f"step 3 of rank 0 was checked on the statistics of its index only: {step_file} "
            "is truncated") in out  # fmt: skip


def test_a_values_file_altered_after_writing_is_broken_and_the_dump_is_not_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One byte of a value flipped, its statistics whole: check read only the index, which
    the rules judge, and called the dump clean (exit 0). Every values file is read against its
    checksums: the step is judged on its index's statistics, named broken, and the verdict is
    not "clean"."""
    dump = write_dump(tmp_path / "run", nan_at=None)
    step_file = _flip_a_value_byte(dump, step=4)
    report = check_dump(load(dump))
    assert report.steps == 6 and report.findings == [] and report.exit_code == 2
    reason = f"{step_file} fails its checksum at net.2.weight: its bytes changed after writing"
    assert report.broken == [{"step": 4, "rank": 0, "reason": reason, "statistics_checked": True}]
    assert main(["check", str(dump)]) == 2
    out = capsys.readouterr().out
    assert f"step 4 of rank 0 was checked on the statistics of its index only: {reason}\n" in out
    assert out.splitlines()[-1] == (
        f"no finding by NaN, Overflow and ExplodingGradient over 54 tensors of 6 steps in {dump}; "
        "not all of the dump could be read (see above)"
    )
    assert main(["check", str(dump), "--json"]) == 2
    report_json = json.loads(capsys.readouterr().out)
    assert report_json["clean"] is False and report_json["broken"][0]["reason"] == reason
    # A NaN elsewhere is still found, and the broken step still said.
    flipped = write_dump(tmp_path / "nan", nan_at=2)
    _flip_a_value_byte(flipped, step=4)
    assert main(["check", str(flipped)]) == 1
    assert "step 4 of rank 0 was checked on the statistics" in capsys.readouterr().out


def _flip_a_value_byte(dump: Path, step: int) -> Path:
    """One bit pattern of a dumped value changed (net.2.weight, the step's last value), its
    statistics in the index left whole; the step's values file."""
    step_file = dump / "rank-0" / f"step-{step:08d}.safetensors"
    data = bytearray(step_file.read_bytes())
    data[-3] ^= 0xFF
    step_file.write_bytes(bytes(data))
    return step_file


def _dump_without_loss(path: Path, nan_at: int | None = None) -> Path:
    """write_dump's network, statistics only, without the loss: a run that never observed it."""
    writer = DumpWriter(path, {"run_id": "noloss", "rules": [{"name": "NaN"}]})
    for step in range(6):
        entries = []
        for entry, value in step_tensors(step, nan_at):
            if entry["name"] != "loss":
                stats = {str(s): v for s, v in compute_numpy(value, STATS).items()}
                entries.append({**entry, "shape": list(value.shape), "dtype": str(value.dtype),
                                "stats": stats})  # fmt: skip
        writer.write_step(step, 0, entries, {}, [])
    writer.close()
    return path


def test_a_rule_with_nothing_to_judge_is_said_in_the_verdict_and_is_not_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LossNotDecreasing on a dump that holds no loss judged nothing, and the verdict called it
    clean (exit 0). The last line says which rule had nothing to judge and how to give it
    something; the exit status is 2, as for a dump that could not all be read."""
    dump = str(_dump_without_loss(tmp_path / "run"))
    assert main(["check", dump, "--rules", "NaN,LossNotDecreasing"]) == 2
    nothing = (
        "nothing to judge for LossNotDecreasing: the dump holds no tensor it watches (a loss: "
        "observe it with session.observe('loss', loss))"
    )
    out = capsys.readouterr().out
    assert (
        out.splitlines()[-1] == f"no finding by NaN over 48 tensors of 6 steps in {dump}; {nothing}"
    )
    assert main(["check", dump, "--rules", "NaN,LossNotDecreasing", "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["clean"] is False
    assert report["nothing_judged"] == [{"rule": "LossNotDecreasing", "watched": 0,
                                         "reason": nothing}]  # fmt: skip
    # With a finding, the rule is not said to have "found nothing": it judged nothing.
    hit = str(_dump_without_loss(tmp_path / "hit", nan_at=3))
    assert main(["check", hit, "--rules", "NaN,LossNotDecreasing"]) == 1
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert verdict == f"1 finding over 48 tensors of 6 steps in {hit}, by NaN (1); {nothing}"
    # A rule that watches tensors but could judge none of them: the same.
    updates = str(write_dump(tmp_path / "updates", nan_at=None, updates_at=range(6)))
    assert main(["check", updates, "--rules", "WeightUpdateRatio"]) == 2
    out = capsys.readouterr().out
    assert "WeightUpdateRatio could not judge 12 tensors: it asks how the optimizer step" in out
    assert out.splitlines()[-1] == (
        f"no rule could judge anything in 66 tensors of 6 steps in {updates}; WeightUpdateRatio "
        "could not judge any of the 12 tensors it watches (see above)"
    )
    assert main(["check", updates, "--rules", "WeightUpdateRatio", "--strict"]) == 2
    capsys.readouterr()


def test_strict_fails_what_the_default_passes_and_never_passes_what_it_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rule that judged nothing exits 2; ``--strict`` made it 1, more lenient than without.
    It exits 1 where the default passes a dump some of whose tensors a rule could not judge,
    and keeps 2 where the default gives 2."""
    updates = str(write_dump(tmp_path / "updates", nan_at=None, updates_at=range(6)))
    assert main(["check", updates, "--rules", "WeightUpdateRatio"]) == 2
    assert main(["check", updates, "--rules", "WeightUpdateRatio", "--strict"]) == 2
    # The gradients of steps 1 and 2 judged from their values, the others not.
    some = str(write_dump(tmp_path / "some", stats=(MIN, MAX), values=[1, 2], nan_at=None))
    assert main(["check", some, "--rules", "VanishingGradient"]) == 0
    assert main(["check", some, "--rules", "VanishingGradient", "--strict"]) == 1
    capsys.readouterr()


def test_a_step_whose_index_line_is_broken_is_not_counted_as_not_dumped(tmp_path: Path) -> None:
    """Steps 0-5 but 2 dumped, step 4's index line altered: step 4 was dumped and could not be
    read, so 1 step was not dumped, not 2."""
    dump = write_dump(tmp_path / "run", steps=[0, 1, 3, 4, 5], nan_at=None)
    _alter_index_line(dump, 4)
    report = check_dump(load(dump))
    assert [(b["step"], b["statistics_checked"]) for b in report.broken] == [(4, False)]
    notes = [note for note in report.notes if "not dumped" in note]
    assert len(notes) == 1 and notes[0].startswith("rank 0: 1 of steps 0-5 was not dumped")


def test_a_rule_that_could_judge_some_tensors_only_keeps_the_verdict_from_saying_clean() -> None:
    """Some tensors a rule watches unjudged, the others judged: exit 0 (``--strict`` fails it),
    and the verdict says which rule could not judge how many."""
    from tensordbg.offline.check import CheckReport, Unjudged

    report = CheckReport("runs/x", "run1", ["NaN()", "VanishingGradient()"], [0], 6, 60)
    report.unjudged.append(Unjudged("VanishingGradient", ["l2"], 3, "fc.weight.grad", 2))
    assert report.exit_code == 0 and not report.clean and report.as_json()["clean"] is False
    assert report.table().splitlines()[-1] == (
        "no finding by NaN and VanishingGradient over 60 tensors of 6 steps in runs/x; "
        "VanishingGradient could not judge 3 tensors (see above)"
    )


def test_an_incomplete_dump_says_the_reason_its_run_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dump whose writer fell behind is incomplete for that reason, not because the run
    stopped before it was closed: the report says what meta.json says. It is not clean: a CI
    job does not pass a dump that does not hold all the run wrote (it said "clean", exit 0)."""
    dump = write_dump(tmp_path / "run", nan_at=None)
    meta_path = dump / "rank-0" / "meta.json"
    meta = json.loads(meta_path.read_text())
    reason = "the writer fell behind and dropped periodic steps 5"
    meta.update(complete=False, reason_incomplete=reason)
    meta_path.write_text(json.dumps(meta))
    assert main(["check", str(dump)]) == 2
    out = capsys.readouterr().out
    assert f"the dump is incomplete: {reason}\n" in out and "stopped before" not in out
    assert out.splitlines()[-1] == (f"no finding by NaN, Overflow and ExplodingGradient over 54 "
                                    f"tensors of 6 steps in {dump}; the dump is incomplete (see "
                                    "above)")  # fmt: skip
    assert main(["check", str(dump), "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["complete"] is False and report["reason_incomplete"] == reason
    assert report["clean"] is False
    assert main(["check", str(dump), "--strict"]) == 2


def test_a_killed_runs_dump_is_not_clean_and_its_findings_still_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run SIGKILLed midway leaves its meta.json as written at the start (not finished):
    check said "clean" and exited 0. A finding in what was written still exits 1."""
    for name, nan_at, code in (("clean", None, 2), ("nan", 3, 1)):
        dump = write_dump(tmp_path / name, nan_at=nan_at)
        meta_path = dump / "rank-0" / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta.update(complete=False, reason_incomplete=NOT_FINISHED)  # as the writer leaves it
        meta_path.write_text(json.dumps(meta))
        assert main(["check", str(dump)]) == code
        out = capsys.readouterr().out
        assert "clean:" not in out, out
        assert f"the dump is incomplete: {NOT_FINISHED}" in out
        assert main(["check", str(dump), "--json"]) == code
        assert json.loads(capsys.readouterr().out)["clean"] is False


def test_a_dump_of_which_nothing_could_be_read_is_not_called_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = write_dump(tmp_path / "run")
    index = dump / "rank-0" / "index.jsonl"
    index.write_bytes(index.read_bytes()[:100])  # no whole line left: no step to check
    assert main(["check", str(dump)]) == 2
    out = capsys.readouterr().out
    assert f"rank 0 could not be read whole: {index} is cut short (100 of" in out
    assert f"nothing could be read: no step of {dump} was checked" in out
    assert "clean" not in out


def test_a_dump_whose_index_was_cut_after_the_run_is_reported_incomplete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its last line gone after the run closed it (a copy cut short): the JSON said
    ``"complete": true`` beside a broken index, and a CI job reading it was misled."""
    dump = write_dump(tmp_path / "run", nan_at=None)
    index = dump / "rank-0" / "index.jsonl"
    index.write_bytes(b"".join(index.read_bytes().splitlines(keepends=True)[:-1]))
    main(["check", str(dump), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["complete"] is False and "is cut short" in report["reason_incomplete"]
    main(["check", str(dump)])
    out = capsys.readouterr().out
    assert out.count("is cut short") == 1, out  # said once, in the table


def test_the_verdict_says_which_rules_found_something_and_which_ran_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ "2 findings: NaN, Overflow, ExplodingGradient over ..." read as if the three rules had
    fired; the verdict counts each rule's findings and names those that found nothing. The
    note on steps not dumped concerns the rules that compare a step with earlier ones: it
    names those that ran, and is left out when none did."""
    dump = str(write_dump(tmp_path / "run", steps=[0, 2, 3], nan_at=3))
    assert main(["check", dump]) == 1
    out = capsys.readouterr().out
    verdict = f"2 findings over 27 tensors of 3 steps in {dump}, by NaN (2); "
    assert verdict + "Overflow and ExplodingGradient found nothing" in out
    note = (
        "1 of steps 0-3 was not dumped (the dump holds only the steps with hits): rules "
        "that compare a tensor with its earlier steps (ExplodingGradient's growth) saw"
    )
    assert note in out
    assert main(["check", dump, "--rules", "NaN"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-2] == f"2 findings over 27 tensors of 3 steps in {dump}, by NaN (2)"
    assert "not dumped" not in out
    one = str(write_dump(tmp_path / "one", steps=[0], nan_at=None))
    assert main(["check", one]) == 0
    assert "over 9 tensors of 1 step in" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["no index", "no meta", "wrong version", "not json"])
def test_an_unreadable_dump_is_one_sentence_naming_the_file_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """A deleted meta.json was "not a tensordbg dump (it holds no rank-N/meta.json)" beside
    its index and steps, and ``check --json`` printed nothing for a CI job to parse (found
    trying the product as a new user)."""
    import json

    dump = write_dump(tmp_path / "run")
    meta = dump / "rank-0" / "meta.json"
    if damage == "no index":
        (dump / "rank-0" / "index.jsonl").unlink()
    elif damage == "no meta":
        meta.unlink()
    elif damage == "wrong version":
        meta.write_text(meta.read_text().replace('"format_version": 1', '"format_version": 99'))
    else:
        meta.write_text("{not json")
    for command in (["check", str(dump)], ["diff", str(dump), str(dump)], ["replay", str(dump)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and str(dump / "rank-0") in err
    assert main(["check", str(dump), "--json"]) == 2
    said = json.loads(capsys.readouterr().out)
    assert said["dump"] == str(dump) and str(dump / "rank-0") in said["error"]


def test_a_rule_on_updates_that_a_dump_cannot_judge_is_said_in_words() -> None:
    """An update is measured against the parameter before the step, which no dump holds: the
    sentence says that, not only the statistic's name (a person read it as jargon)."""
    from tensordbg.offline.check import CheckReport, Unjudged

    report = CheckReport("runs/x", "run1", ["WeightNotChanging"], [0], 6, 60)
    missing = ["update_unchanged(1e-05, 1e-08)"]
    report.unjudged.append(Unjudged("WeightNotChanging", missing, 60, "fc.weight.update", 2))
    line = next(line for line in report.table().splitlines() if "could not judge" in line)
    assert line.startswith(
        "WeightNotChanging could not judge 60 tensors: it asks how the optimizer"
    )
    assert "(whether the step left the parameter unchanged)" in line and "update_" not in line
    assert "measured against the parameter before the step" in line
    assert line.endswith("(first: fc.weight.update at step 2)")


def test_advice_given_to_some_of_a_rules_findings_says_how_many_of_them():
    """ExplodingGradient gives one advice for a NaN gradient and another for a norm past its
    bound: "about the 388 ExplodingGradient findings" read wrong beside the 433 the summary
    counted."""
    from tensordbg.offline.check_report import CheckReport, Finding

    def finding(step: int, advice: str) -> Finding:
        return Finding(step, 0, "backward", 0, "w.grad", "", "grad", "ExplodingGradient", 1e9,
                       1e4, "w.grad is large", advice=advice)  # fmt: skip

    report = CheckReport("d", "r", ["ExplodingGradient"], [0], 3, 3)
    report.findings = [finding(0, "clip it"), finding(1, "clip it"), finding(2, "find the NaN")]
    table = report.table()
    assert "about 2 of the 3 ExplodingGradient findings: clip it" in table
    assert "about 1 of the 3 ExplodingGradient findings: find the NaN" in table


def test_a_gradient_four_micro_batches_found_is_one_row_naming_its_rules_once():
    """ "ExplodingGradient, NaN, ExplodingGradient, NaN, ..." once per micro-batch."""
    from tensordbg.offline.check_report import CheckReport, Finding

    report = CheckReport("d", "r", ["ExplodingGradient", "NaN"], [0], 1, 1)
    report.findings = [Finding(3, 0, "backward", 0, "fc.bias.grad", "", "grad", rule, 1e9, 1e4,
                               "fc.bias.grad holds 1 NaN")
                       for _ in range(4) for rule in ("ExplodingGradient", "NaN")]  # fmt: skip
    rows = [line for line in report.table().splitlines() if line.startswith("step 3")]
    assert len(rows) == 1 and rows[0].count("ExplodingGradient") == rows[0].count("NaN") == 1


def test_a_run_whose_rules_cannot_be_rebuilt_is_checked_with_the_defaults_and_says_so() -> None:
    """A run recorded with only a rule not installed here was judged by the default rules
    without a word; rules that are not a list were read letter by letter."""
    from tensordbg.offline.recorded_rules import recorded_rules
    from tensordbg.rules import default_rules

    defaults = [repr(r) for r in default_rules()]
    notes: list[str] = []
    assert [repr(r) for r in recorded_rules({"rules": [{"name": "Mine"}]}, notes)] == defaults
    assert notes == ["the run's rule Mine is not installed here: it was not checked",
                     "none of the run's rules can be used here: checked with the default rules "
                     "instead"]  # fmt: skip
    notes = []
    assert [repr(r) for r in recorded_rules({"rules": "junk"}, notes)] == defaults
    assert len(notes) == 1 and "not a list (str)" in notes[0]


def test_a_run_of_a_rule_not_installed_here_is_never_called_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run hit 8 times by its own rule, not installed where check runs: check said "clean",
    exit 0, with --strict too, a CI gate passing a dump that records hits."""
    from tensordbg.rules import Finding, Rule
    from tensordbg.statistics import MAX

    class LargeActivation(Rule):
        needs = (MAX,)
        kinds = frozenset({"output"})

        def check(self, t, state):
            peak = t.values.get(MAX)
            return Finding(peak, 0.0, f"{t.name} reaches {peak:.3g}.") if peak > 0 else None

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    session = tensordbg.attach(model, rules=[LargeActivation()], on_hit="record", server=False,
                               dump_dir=tmp_path / "run", summary_at_exit=False)  # fmt: skip
    for _ in range(4):
        model(torch.randn(8, 4))
    session.detach()
    recorded = len(load(tmp_path / "run").hits)
    assert recorded >= 4
    assert main(["check", str(tmp_path / "run"), "--strict"]) == 2
    out = capsys.readouterr().out
    assert "clean" not in out.splitlines()[-1]
    assert (
        f"the run's rule LargeActivation could not be checked here: the run recorded {recorded}"
        in out
    )
    assert main(["check", str(tmp_path / "run"), "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["clean"] is False and report["unchecked_rules"] == {"LargeActivation": recorded}


def test_the_last_line_names_every_rule_that_found_the_origin(tmp_path: Path) -> None:
    """A module that made a NaN and an Inf: the line named the NaN alone."""

    class Fault(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.log(x - 10)
            y[0, 0] = float("inf")
            return y

    model = nn.Sequential(nn.Linear(4, 4), Fault(), nn.Linear(4, 2))
    session = tensordbg.attach(model, rules=[NaN(), tensordbg.rules.Overflow()], on_hit="record",
                               server=False, dump_dir=tmp_path, summary_at_exit=False)  # fmt: skip
    model(torch.randn(3, 4))
    session.detach()
    assert "it arose at 1.output, step 0 (NaN, Overflow); " in check_dump(load(tmp_path)).table()


def test_the_last_line_says_there_are_other_origins_when_there_are(tmp_path: Path) -> None:
    """A NaN at step 0 and a new one at step 2 that came in with the batch, both origins: the
    line said the second spread from the first."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    session = tensordbg.attach(model, rules=[NaN()], on_hit="record", server=False,
                               dump_dir=tmp_path, summary_at_exit=False)  # fmt: skip
    for step in range(3):
        x = torch.randn(3, 4)
        if step == 2:
            x[0, 0] = float("nan")
        with torch.no_grad():
            model(torch.log(x - 10) if step == 0 else x)
    session.detach()
    table = check_dump(load(tmp_path)).table()
    assert "(1 other origin after it, above, each a problem of its own);" in table, table
    assert "findings are where they spread" in table


class _Normalize(nn.Module):
    """Its own code divides by each row's norm: 0/0 on a constant row."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = h - h.mean(dim=-1, keepdim=True)
        return h / h.norm(dim=-1, keepdim=True)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(4, 8), _Normalize(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.inp(x))))  # tanh: made between modules


def test_check_names_a_gradient_passed_on_as_the_run_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run named the gradient of the input norm.lin took "norm.lin.grad_input[0]" (module
    norm.lin); it is dumped as norm.grad_input[0], and check said that name and module."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, rules=[NaN()], on_hit="record", server=False,
                               sync="eager", dump_dir=tmp_path, summary_at_exit=False)  # fmt: skip
    with torch.no_grad():
        model.norm.lin.weight.zero_()  # every row constant: 0/0 from the first step
        model.norm.lin.bias.zero_()
    model(torch.randn(4, 4)).pow(2).mean().backward()
    live = {(h.tensor, h.module) for h in session.hits if h.stored_as}
    session.detach()
    assert ("norm.lin.grad_input[0]", "norm.lin") in live, live
    assert main(["check", str(tmp_path), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)["findings"]
    named = {(r["tensor"], r["module"]) for r in rows if r["stored_as"]}
    assert named == live


def test_a_scalar_loss_is_judged_on_its_range_from_its_dumped_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Of a one-element tensor the mean is its minimum and its maximum: TensorRange on the
    loss "could not judge 6 tensors: the dump holds neither their maximum..."."""
    from tensordbg.statistics import MEAN

    dump = write_dump(tmp_path / "run", stats=(MEAN,), values=False, nan_at=None)
    report = check_dump(load(dump), [TensorRange(match="loss", max_gt=0.0)])
    assert report.unjudged == [] and report.nothing_judged == []
    assert [(f.tensor, f.step) for f in report.findings] == [("loss", s) for s in range(6)]
    assert report.findings[0].value == load(dump).tensor("loss").stats(0)["mean"]


def test_a_rule_whose_window_the_dump_is_too_short_for_is_not_called_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LossNotDecreasing compares the mean loss of 10 steps with that of the 10 before: on a
    dump of 6 steps it reached no verdict, and check said "clean" (exit 0). It says what the
    rule could not judge and why, and exits 2, as for a rule that judged nothing."""
    from tensordbg.rules import LossNotDecreasing

    dump = write_dump(tmp_path / "run", nan_at=None)
    report = check_dump(load(dump), rules=[LossNotDecreasing()])
    assert report.exit_code == 2 and not report.clean
    assert [(u.rule, u.tensors, u.first_tensor) for u in report.unjudged] == [
        ("LossNotDecreasing", 6, "loss")
    ]
    assert "takes 21 steps of loss" in report.unjudged[0].reason
    assert report.unjudged[0].reason.endswith("and it saw 6")
    assert [j.rule for j in report.nothing_judged] == ["LossNotDecreasing"]
    assert main(["check", str(dump), "--rules", "NaN,LossNotDecreasing", "--json"]) == 2
    said = json.loads(capsys.readouterr().out)
    assert said["clean"] is False
    assert said["unjudged"][0]["reason"].startswith("LossNotDecreasing could not judge 6 tensors:")
    assert main(["check", str(dump), "--rules", "LossNotDecreasing"]) == 2
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == (
        f"no rule could judge anything in 54 tensors of 6 steps in {dump}; LossNotDecreasing "
        "could not judge any of the 6 tensors it watches (see above)"
    )
    # A window the dump holds: compared, and clean.
    short = check_dump(load(dump), rules=[LossNotDecreasing(num_steps=2)])
    assert short.unjudged == [] and short.nothing_judged == [] and short.exit_code == 0


def test_the_table_and_the_json_list_the_findings_in_the_same_execution_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table put a step's origin first, the JSON went by the dumped order, which lists a
    weight the run read out of turn (its module's output about to be named an origin) after
    that output; and a pass's finite gradients, judged together at its end, came after a NaN
    the autograd engine made later. Both now list execution order: the weight before the
    output its module computed with it, an earlier finding before the origin."""
    from tensordbg.rules import ExplodingGradient, Overflow

    def entry(name: str, module: str, kind: str, phase: str, **stats: float) -> dict[str, object]:
        return {"name": name, "module": module, "kind": kind, "phase": phase,
                "module_type": "Linear", "shape": [4, 4], "dtype": "float32",
                "stats": {"finite": 1.0, "nan": 0.0, "posinf": 0.0, "neginf": 0.0,
                          **stats}}  # fmt: skip

    entries = [entry("input[0]", "", "input", "forward", finite=0.0, posinf=1.0),
               entry("fc.output", "fc", "output", "forward", finite=0.0, nan=3.0),
               entry("fc.weight", "fc", "param", "forward", finite=0.0, posinf=1.0),
               entry("fc.weight.grad", "fc", "grad", "backward", l2=1e9),
               entry("fc.grad_input[0]", "fc", "grad_input", "backward", finite=0.0,
                     nan=5.0)]  # fmt: skip
    hit = {"rule": "Overflow", "tensor": "fc.weight", "module": "fc", "kind": "param",
           "step": 0, "phase": "forward", "origin": True, "value": 1.0, "threshold": None,
           "id": 0, "call": 0, "message": "fc.weight holds 1 infinite value"}  # fmt: skip
    rules = [{"name": "NaN"}, {"name": "Overflow"}, {"name": "ExplodingGradient"}]
    writer = DumpWriter(tmp_path, {"run_id": "r1", "rules": rules})
    writer.write_step(0, 0, entries, {}, [hit])
    writer.close()
    order = ["input[0]", "fc.weight", "fc.output", "fc.weight.grad", "fc.grad_input[0]"]
    report = check_dump(load(tmp_path), rules=[NaN(), Overflow(), ExplodingGradient()])
    assert [f.tensor for f in report.findings] == order
    assert main(["check", str(tmp_path), "--json"]) == 1
    assert [f["tensor"] for f in json.loads(capsys.readouterr().out)["findings"]] == order
    assert main(["check", str(tmp_path)]) == 1
    rows = [line.split()[-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("step 0")]  # fmt: skip
    assert rows == ["input[0]", "origin", *order[2:]]  # fc.weight's row ends "<- origin"


def test_a_rule_that_watches_some_module_types_says_so_when_there_are_none(
    tmp_path: Path,
) -> None:
    """SaturatedActivation on a network without Tanh or Sigmoid said the dump holds no "module's
    output", though every module's output was dumped."""
    from tensordbg.rules import SaturatedActivation

    report = check_dump(load(write_dump(tmp_path / "run")), rules=[SaturatedActivation()])
    assert [j.reason for j in report.nothing_judged] == [
        "nothing to judge for SaturatedActivation: the dump holds no tensor it watches (the "
        "output of a Tanh or Sigmoid module)"
    ]
    named = check_dump(load(tmp_path / "run"), rules=[DeadActivation(match="*.act.output")])
    assert named.nothing_judged[0].reason.endswith("(a module's output named *.act.output)")
