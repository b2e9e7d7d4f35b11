"""Dumps, the reading and writing sides at the numpy level: round trips bit for bit, the reader
without torch, corruption named in one sentence with the other steps still readable, eviction,
and atomicity under SIGKILL."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
from dumps import weight_checked_twice

import tensordbg
from tensordbg.dump import DumpError, load
from tensordbg.dump import format as fmt
from tensordbg.dump.writer import DumpWriter

ROOT = Path(__file__).resolve().parents[1]


def _bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def _values(seed: int = 0) -> dict[str, np.ndarray]:
    """One tensor of every dtype the engine captures, with the awkward values in it."""
    rng = np.random.default_rng(seed)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f32[0, 0], f32[1, 1], f32[2, 2] = np.nan, np.inf, -0.0
    return {
        "fc.output": f32,
        "fc.weight.grad": rng.standard_normal((4, 2)).astype(np.float16),
        "attn.output": np.array([1.5, np.nan, -np.inf, 3e38], dtype=ml_dtypes.bfloat16),
        "fp8.e4m3": np.array([448, -0.5, np.nan, 0], dtype=ml_dtypes.float8_e4m3fn),
        "fp8.e5m2": np.array([57344, -np.inf, 1e-5], dtype=ml_dtypes.float8_e5m2),
        "double": np.array([np.pi], dtype=np.float64),
        "ids": np.arange(-3, 3, dtype=np.int64).reshape(2, 3),
        "small": np.array([1, -1], dtype=np.int8),
        "mask": np.array([[True, False]]),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def _entries(values: dict[str, np.ndarray], phase: str = "forward") -> list[dict]:
    return [
        {"name": name, "module": name.rsplit(".", 1)[0], "phase": phase, "kind": "output",
         "shape": list(v.shape), "dtype": fmt.dtype_name(v.dtype), "stats": {"l2": 1.0}}
        for name, v in values.items()
    ]  # fmt: skip


def _hit(step: int, tensor: str = "fc.output") -> dict:
    return {"rule": "NaN", "tensor": tensor, "module": "fc", "kind": "output", "step": step,
            "phase": "forward", "origin": True, "value": 1.0, "threshold": None,
            "message": f"NaN in {tensor} at step {step}", "id": step, "ref": 0, "call": 0,
            "summary": {"shape": [3, 5], "nan": 1}, "rank": 0, "stored_as": ""}  # fmt: skip


def _write(path: Path, steps=(0, 1, 2), values=None, **kwargs) -> DumpWriter:
    values = _values() if values is None else values
    writer = DumpWriter(path, {"run_id": "r1", "argv": ["train.py"]}, **kwargs)
    for step in steps:
        writer.write_step(step, 0, _entries(values), values, [])
    writer.close()
    return writer


# --- round trips ------------------------------------------------------------------------------


def test_every_dtype_round_trips_bit_for_bit_without_widening(tmp_path):
    values = _values()
    _write(tmp_path, steps=(7,), values=values)
    dump = tensordbg.load(tmp_path)
    assert dump.steps() == [7] and dump.meta["complete"] and dump.meta["run_id"] == "r1"
    for name, expected in values.items():
        got = dump.tensor(name).value(7)
        assert got.dtype == expected.dtype, name  # bfloat16 stays bfloat16, fp8 stays fp8
        assert got.shape == expected.shape, name
        assert _bits(got) == _bits(expected), name


def test_entries_list_in_execution_order_with_their_statistics(tmp_path):
    values = _values()
    _write(tmp_path, steps=(0,), values=values)
    entries = load(tmp_path).tensors(0)
    assert [e.name for e in entries] == list(values)
    assert [e.order for e in entries] == list(range(len(values)))
    first = entries[0]
    assert (first.module, first.phase, first.kind, first.shape, first.dtype) == (
        "fc", "forward", "output", (3, 5), "float32")  # fmt: skip
    assert first.stats == {"l2": 1.0} and first.has_value


def test_entries_encoded_ahead_read_back_as_the_plain_ones(tmp_path, monkeypatch):
    """The session's writer encodes what does not change from step to step once per tensor;
    what a reader gets is the same as from plain entries, awkward numbers included, and an
    entry whose value is stored gets its key and checksum as any other."""
    stats = {"finite": 0.0, "min": float("nan"), "max": float("inf"), "mean": -float("inf"),
             "l2": 0.1 + 0.2, "nan": 3, "tiny": 5e-324}  # fmt: skip
    fields = ("fc.output", "fc", "forward", "output", (3, 5), "float32", "Linear", 1, False)
    value = _values()["fc.output"]
    encoder = fmt.EntryEncoder()
    plain = [{**dict(zip(fmt.EntryEncoder.FIELDS, fields, strict=True)), "shape": [3, 5],
              "stats": stats}, {**_entries({"b.output": value})[0]}]  # fmt: skip
    encoded = [
        encoder.encode(fields, stats),
        encoder.encode(
            ("b.output", "b", "forward", "output", (3, 5), "float32", "", 0, False), {"l2": 1.0}
        ),
    ]
    for path, entries in ((tmp_path / "plain", plain), (tmp_path / "encoded", encoded)):
        writer = DumpWriter(path, {})
        for step in (0, 1):
            writer.write_step(step, 0, entries, {"b.output": value} if step else {}, [])
        writer.close()
    a, b = load(tmp_path / "plain"), load(tmp_path / "encoded")
    for step in (0, 1):
        for x, y in zip(a.tensors(step), b.tensors(step), strict=True):
            assert (x.name, x.order, x.shape, x.module, x.has_value) == (
                y.name, y.order, y.shape, y.module, y.has_value)  # fmt: skip
            assert json.dumps(x.stats, sort_keys=True) == json.dumps(y.stats, sort_keys=True)
    monkeypatch.setattr(fmt, "HEADS_KEPT", 2)  # shapes that vary: the heads kept are bounded
    for n in range(5):
        encoder.encode(("x", "", "forward", "output", (n,), "float32", "", 0, False), {})
    assert len(encoder._heads) <= 2
    got = b.tensors(0)[0]
    assert got.stats["l2"] == 0.1 + 0.2 and got.stats["nan"] == 3 and math.isnan(got.stats["min"])
    assert got.stats["max"] == math.inf and got.stats["tiny"] == 5e-324
    assert _bits(b.tensor("b.output").value(1)) == _bits(value)


def test_statistics_only_steps_write_no_tensor_file_and_say_why_a_value_is_absent(tmp_path):
    writer = DumpWriter(tmp_path, {})
    stats = {"min": float("nan"), "l2": 2.0}
    entries = [{"name": "fc.output", "module": "fc", "phase": "forward", "kind": "output",
                "shape": [3], "dtype": "float32", "stats": stats}]  # fmt: skip
    writer.write_step(10, 0, entries, {}, [])
    writer.close()
    assert not list((tmp_path / "rank-0").glob("*.safetensors"))
    tensor = load(tmp_path).tensor("fc.output")
    assert tensor.steps() == [10]
    stats = tensor.stats(10)
    assert stats["l2"] == 2.0 and np.isnan(stats["min"])
    with pytest.raises(DumpError, match=r"statistics of fc\.output but not its value"):
        tensor.value(10)


def test_plain_safetensors_reads_the_files(tmp_path):
    values = _values()
    _write(tmp_path, steps=(3,), values=values)
    path = tmp_path / "rank-0" / "step-00000003.safetensors"
    with safetensors.safe_open(str(path), framework="np") as f:
        assert set(f.keys()) == set(values)
        assert _bits(f.get_tensor("fc.output")) == _bits(values["fc.output"])
        assert f.get_slice("ids")[1:2].tolist() == [[0, 1, 2]]
    torch = pytest.importorskip("torch")
    with safetensors.safe_open(str(path), framework="pt") as f:
        bf16 = f.get_tensor("attn.output")
        assert bf16.dtype == torch.bfloat16
        assert bf16.view(torch.int16).numpy().tobytes() == _bits(values["attn.output"])
        assert f.get_tensor("fp8.e4m3").dtype == torch.float8_e4m3fn


def test_hits_and_modules_and_meta_come_back(tmp_path):
    writer = DumpWriter(tmp_path, {"run_id": "r2", "torch_version": "2.13.0", "device": "cpu"})
    modules = [{"path": "", "type": "Net", "depth": 0, "params": 10, "hits": 1, "calls": 1,
                "stats": {}}]  # fmt: skip
    writer.write_step(4, 0, _entries(_values()), {}, [_hit(4)], modules=modules)
    writer.close()
    dump = load(tmp_path)
    (hit,) = dump.hits
    assert isinstance(hit, tensordbg.Hit)
    assert hit.as_dict() == _hit(4)
    assert dump.modules == modules
    assert dump.meta["torch_version"] == "2.13.0" and dump.meta["format_version"] == 1


def test_writing_a_step_again_replaces_it(tmp_path):
    values = _values()
    writer = DumpWriter(tmp_path, {})
    writer.write_step(5, 0, _entries(values)[:1], {"fc.output": values["fc.output"]}, [_hit(5)])
    later = {"fc.output": values["fc.output"] * 2}
    writer.write_step(5, 0, _entries(values)[:2], later, [_hit(5)])
    writer.close()
    dump = load(tmp_path)
    assert dump.steps() == [5] and len(dump.tensors(5)) == 2
    assert _bits(dump.tensor("fc.output").value(5)) == _bits(later["fc.output"])
    assert len(list((tmp_path / "rank-0").glob("*.safetensors"))) == 1


def test_a_slice_of_a_large_tensor_is_memory_mapped(tmp_path):
    big = np.arange(4 * 2**20, dtype=np.float32).reshape(2048, 2048)
    writer = DumpWriter(tmp_path, {})
    writer.write_step(0, 0, _entries({"big": big}), {"big": big}, [])
    writer.close()
    value = load(tmp_path).tensor("big").value(0)
    assert not value.flags.writeable and not value.flags.owndata
    assert value[1000, 5:8].tolist() == [2048000 + 5, 2048000 + 6, 2048000 + 7]


def test_a_second_run_in_the_same_directory_replaces_the_first(tmp_path):
    _write(tmp_path, steps=(0, 1, 2))
    _write(tmp_path, steps=(9,))
    assert load(tmp_path).steps() == [9]


# --- the reader imports no torch ----------------------------------------------------------------


def test_the_reader_works_with_torch_unimportable(tmp_path):
    _write(tmp_path, steps=(0, 1))
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import tensordbg
        dump = tensordbg.load({str(tmp_path)!r})
        value = dump.tensor("attn.output").value(1)
        print(dump.steps(), value.dtype, len(dump.tensors(0)))
        assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules
                       if sys.modules[m] is not None)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 1] bfloat16 11"


# --- corruption: one sentence naming the file, the rest readable ----------------------------------


def test_a_cut_file_breaks_only_its_step(tmp_path):
    _write(tmp_path)
    path = tmp_path / "rank-0" / "step-00000001.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    dump = load(tmp_path)
    assert dump.steps() == [0, 1, 2]
    assert "step-00000001.safetensors is truncated (100 of" in dump.broken[(1, 0)]
    with pytest.raises(DumpError, match=r"step-00000001.safetensors is truncated"):
        dump.tensor("fc.output").value(1)
    assert _bits(dump.tensor("fc.output").value(2)) == _bits(_values()["fc.output"])


def test_flipped_bytes_fail_the_checksum(tmp_path):
    _write(tmp_path)
    path = tmp_path / "rank-0" / "step-00000002.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # in the bytes of "scalar" (the last tensor, "empty", has none)
    path.write_bytes(bytes(data))
    dump = load(tmp_path)
    assert dump.verify() == {
        (2, 0): f"{path} fails its checksum at scalar: its bytes changed after writing"
    }
    with pytest.raises(DumpError, match=r"step-00000002\.safetensors fails its checksum"):
        load(tmp_path).tensor("scalar").value(2)  # checked when read, without verify()
    assert load(tmp_path).tensor("scalar").value(1) == 2.5


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_verify_keeps_no_file_open_and_reads_the_ranks_asked(tmp_path):
    """A mapped file holds a descriptor: verify() of a dump of thousands of steps kept one per
    step and ran out of them. It closes what it mapped only to check."""
    _write(tmp_path, steps=range(20))
    path = tmp_path / "rank-0" / "step-00000007.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    dump = load(tmp_path)
    assert dump.verify(ranks=[1]) == {}  # rank 0 not asked: not read
    open_before = len(os.listdir("/proc/self/fd"))
    assert list(dump.verify()) == [(7, 0)]
    assert len(os.listdir("/proc/self/fd")) == open_before
    assert dump.tensor("fc.output").value(3).shape == (3, 5)  # still readable after it


def test_reading_a_tensor_at_every_step_keeps_a_bounded_number_of_files_open(tmp_path, monkeypatch):
    """Each step read stayed mapped, and a mapping holds a descriptor: reading one tensor across
    the 932 steps of a dump failed with "Too many open files" under macOS's limit of 256."""
    from tensordbg.dump import reader

    monkeypatch.setattr(reader, "MAPS_KEPT", 4, raising=False)
    _write(tmp_path, steps=range(30))
    dump = load(tmp_path)
    tensor = dump.tensor("fc.output")
    open_before = len(os.listdir("/proc/self/fd"))
    kept = tensor.value(0)  # an array the caller keeps: its file stays readable under it
    for step in range(30):
        assert _bits(tensor.value(step)) == _bits(_values()["fc.output"])
    assert len(os.listdir("/proc/self/fd")) <= open_before + 4 + 1
    assert _bits(kept) == _bits(_values()["fc.output"])
    assert _bits(tensor.value(0)) == _bits(kept)  # mapped again once evicted


def test_flipped_bytes_in_the_header_fail_at_first_read(tmp_path):
    _write(tmp_path)
    path = tmp_path / "rank-0" / "step-00000000.safetensors"
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01
    path.write_bytes(bytes(data))
    dump = load(tmp_path)
    with pytest.raises(DumpError, match=r"step-00000000\.safetensors fails its checksum in its"):
        dump.tensor("ids").value(0)
    assert dump.tensor("ids").value(1).shape == (2, 3)


def test_an_index_cut_at_a_line_boundary_is_found_by_its_length(tmp_path, capsys):
    """Whole lines gone leave no cut line to fail a checksum: the length the writer noted in
    meta.json tells, and check does not call such a dump clean."""
    from tensordbg.cli import main

    _write(tmp_path, steps=range(4), values={"x": np.ones(3, dtype=np.float32)})
    index = tmp_path / "rank-0" / fmt.INDEX
    lines = index.read_bytes().splitlines(keepends=True)
    index.write_bytes(b"".join(lines[:-2]))  # steps 2 and 3 gone, every line left whole
    dump = load(tmp_path)
    assert dump.steps() == [0, 1]
    assert "cut short" in dump.broken[(-1, 0)]
    assert main(["check", str(tmp_path)]) == 2
    assert "rank 0 could not be read whole: " in capsys.readouterr().out


def test_a_damaged_index_line_breaks_only_its_step(tmp_path):
    _write(tmp_path)
    index = tmp_path / "rank-0" / "index.jsonl"
    lines = index.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"l2":1.0', b'"l2":9.0', 1)
    index.write_bytes(b"".join(lines))
    dump = load(tmp_path)
    assert dump.steps() == [0, 2]
    assert dump.broken == {(1, 0): f"{index} line 2: the line fails its checksum"}
    with pytest.raises(DumpError, match="line 2: the line fails its checksum"):
        dump.tensors(1)


def test_an_index_line_with_a_step_past_int64_breaks_no_reader(tmp_path):
    """A line with its checksum right but a step of 10**30 (made by hand): replay crashed
    sending it to the UI ("cannot send a value of type int"), check counted 10**30 steps."""
    from tensordbg.dump.format import index_line, parse_index_line

    _write(tmp_path)
    index = tmp_path / "rank-0" / "index.jsonl"
    lines = index.read_bytes().splitlines(keepends=True)
    lines[1] = index_line({**parse_index_line(lines[1]), "step": 10**30})
    index.write_bytes(b"".join(lines))
    dump = load(tmp_path)
    assert dump.steps() == [0, 2]
    assert dump.broken == {(-1, 0): f"{index} line 2 is malformed (its step {10**30} is not a "
                                    "whole number from 0 to 2**63 - 1)"}  # fmt: skip


def test_a_renamed_rank_folder_is_named_not_read_as_an_empty_dump(tmp_path):
    """rank-0 renamed rank-7: check said "nothing to check" and exited 0, replay that no step
    hit, load listed every step's file as missing."""
    _write(tmp_path)
    (tmp_path / "rank-0").rename(tmp_path / "rank-7")
    with pytest.raises(DumpError) as e:
        load(tmp_path)
    index = tmp_path / "rank-7" / "index.jsonl"
    assert str(e.value) == (f"{index} lists the steps of rank 0, not rank 7: its folder was "
                            "renamed (the writer named it rank-0)")  # fmt: skip


def test_a_tensor_dumped_only_in_a_broken_step_is_said_broken_not_unlisted(tmp_path):
    """Replay said "no step lists a tensor 'fault.output'; did you mean 'fault.output'" of a
    tensor dumped only in a step whose file was cut short."""
    _write(tmp_path, steps=(5,))
    step_file = next((tmp_path / "rank-0").glob("step-*"))
    step_file.write_bytes(step_file.read_bytes()[:100])
    dump = load(tmp_path)
    name = dump.indexed(5)[0].name
    with pytest.raises(DumpError) as e:
        dump.tensor(name)
    assert str(e.value).startswith(f"{name!r} is dumped only in step 5 of {tmp_path}, which "
                                   f"cannot be read: {step_file} is truncated")  # fmt: skip


def test_a_directory_where_a_step_file_should_be_is_not_called_truncated(tmp_path):
    _write(tmp_path, steps=(5,))
    step_file = next((tmp_path / "rank-0").glob("step-*"))
    step_file.unlink()
    step_file.mkdir()  # said "truncated (4096 of ... bytes)": a directory's size
    assert load(tmp_path).broken == {(5, 0): f"{step_file} is not a file"}


def test_a_missing_index_is_named(tmp_path):
    _write(tmp_path)
    (tmp_path / "rank-0" / "index.jsonl").unlink()
    with pytest.raises(DumpError) as e:
        load(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'rank-0' / 'index.jsonl'} is missing: the dump has no index of its steps"
    )


def test_an_unknown_format_version_is_named(tmp_path):
    _write(tmp_path)
    meta_path = tmp_path / "rank-0" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DumpError, match=r"meta.json has format version 99; this tensordbg reads"):
        load(tmp_path)


def test_metadata_without_a_format_version_is_not_a_dumps(tmp_path):
    _write(tmp_path)
    (tmp_path / "rank-0" / "meta.json").write_text("{}")
    with pytest.raises(DumpError, match=r"meta.json is not the dump's metadata \(it names no "):
        load(tmp_path)


def test_a_directory_that_is_not_a_dump(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DumpError, match=r"is not a tensordbg dump \(it holds no rank-N/meta.json"):
        load(tmp_path)
    with pytest.raises(DumpError, match="is not a directory"):
        load(tmp_path / "notes.txt")
    with pytest.raises(DumpError, match=r"missing does not exist: give the directory of a"):
        load(tmp_path / "missing")


def test_a_missing_step_file_is_broken_and_named(tmp_path):
    _write(tmp_path)
    (tmp_path / "rank-0" / "step-00000000.safetensors").unlink()
    dump = load(tmp_path)
    assert dump.broken[(0, 0)].endswith("step-00000000.safetensors is missing")
    assert dump.tensor("mask").value(1).tolist() == [[True, False]]


# --- eviction -------------------------------------------------------------------------------------


def test_eviction_keeps_steps_with_hits_and_drops_the_oldest_others(tmp_path):
    value = np.zeros(25_000, dtype=np.float32)  # 100 kB a step
    writer = DumpWriter(tmp_path, {}, max_bytes=450_000)
    for step in range(12):
        hits = [_hit(step)] if step in (1, 6) else []
        writer.write_step(step, 0, _entries({"x": value}), {"x": value}, hits)
    writer.close()
    dump = load(tmp_path)
    steps = dump.steps()
    assert 1 in steps and 6 in steps  # steps with hits stay
    assert steps[-1] == 11 and 0 not in steps and 2 not in steps  # the oldest others went
    on_disk = sum(p.stat().st_size for p in (tmp_path / "rank-0").iterdir())
    assert on_disk <= 450_000 + 4096  # meta.json beside it
    assert len(list((tmp_path / "rank-0").glob("*.safetensors"))) == len(steps)
    assert not dump.broken
    assert [h.step for h in dump.hits] == [1, 6]


def test_a_dump_whose_every_step_hits_stays_bounded_keeping_the_first_and_the_newest(tmp_path):
    """A NaN that stays hits every step: steps with hits were never evicted, and a bounded
    dump grew without bound (420 MB in 7 s for a small model)."""
    value = np.zeros(25_000, dtype=np.float32)  # 100 kB a step
    writer = DumpWriter(tmp_path, {}, max_bytes=450_000)
    for step in range(12):
        writer.write_step(step, 0, _entries({"x": value}), {"x": value}, [_hit(step)])
    writer.close()
    dump = load(tmp_path)
    steps = dump.steps()
    assert steps[0] == 0 and steps[-1] == 11  # where the problem arose, and the newest
    assert steps == [0, *range(12 - len(steps) + 1, 12)]  # the oldest others went
    on_disk = sum(p.stat().st_size for p in (tmp_path / "rank-0").iterdir())
    assert on_disk <= 450_000 + 4096
    assert not dump.broken


# --- atomicity --------------------------------------------------------------------------------


def test_a_hit_steps_index_line_reaches_the_disk_at_once_a_periodic_ones_within_a_second(
    tmp_path, monkeypatch
):
    """An fsync of the index for every periodic step took the writer's thread (which shares
    the training's cores) about 1.6 ms a step: periodic lines are synced at most once a
    SYNC_EVERY (here: never again within the test), a hit step's line and the close at once.
    A line not yet synced is readable all the same (a killed process loses nothing)."""
    from tensordbg.dump import writer as writer_module

    monkeypatch.setattr(writer_module, "SYNC_EVERY", 3600.0)
    index_syncs = []
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(fmt.INDEX):
            index_syncs.append(fd)
        real(fd)

    monkeypatch.setattr(writer_module.os, "fsync", fsync)
    values = {"x": np.ones(4, dtype=np.float32)}
    writer = DumpWriter(tmp_path, {})
    for step in range(5):
        writer.write_step(step, 0, _entries(values), {}, [])
    assert len(index_syncs) == 1  # the first line; the next four wait
    assert load(tmp_path).steps() == [0, 1, 2, 3, 4]  # in the kernel's hands: readable
    writer.write_step(5, 0, _entries(values), {}, [_hit(5)])
    assert len(index_syncs) == 2
    writer.close()
    assert len(index_syncs) == 3
    assert load(tmp_path).steps() == list(range(6))


def test_a_writer_killed_midway_leaves_the_earlier_steps_readable(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, numpy as np
        from tensordbg.dump.writer import DumpWriter
        writer = DumpWriter({str(tmp_path)!r}, {{"run_id": "killed"}})
        value = np.ones(2_000_000, dtype=np.float32)  # 8 MB a step: the kill lands mid-write
        step = 0
        while True:
            writer.write_step(step, 0, [{{"name": "x", "shape": [2_000_000],
                              "dtype": "float32", "stats": {{}}}}], {{"x": value * step}}, [])
            if step == 2:
                print("ready", flush=True)
            step += 1
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    dump = load(tmp_path)
    assert dump.meta["complete"] is False
    assert "did not finish" in dump.meta["reason_incomplete"]
    steps = dump.steps()
    assert steps == list(range(len(steps))) and len(steps) >= 3
    assert not dump.broken
    assert dump.verify() == {}
    for step in steps:
        assert dump.tensor("x").value(step)[-1] == step
    listed = {f"step-{s:08d}.safetensors" for s in steps}
    visible = {p.name for p in (tmp_path / "rank-0").glob("*.safetensors")}
    assert visible <= listed | {f"step-{steps[-1] + 1:08d}.safetensors"}  # renamed, not indexed


def test_a_tensor_no_step_lists_is_refused_at_once_with_the_names_closest_to_it(tmp_path):
    _write(tmp_path, steps=(0, 2, 3, 4))
    dump = load(tmp_path)
    with pytest.raises(DumpError, match=r"lists a tensor 'fc.outptu'; did you mean 'fc.output'"):
        dump.tensor("fc.outptu")
    with pytest.raises(DumpError, match=r"step 1 .*was not dumped \(steps 0, 2-4 were\)"):
        dump.tensor("fc.output").value(1)


# --- what a user found ------------------------------------------------------------------------


def test_a_tensor_checked_in_two_phases_of_a_step_is_read_by_its_phase(tmp_path):
    """``dump.tensor(name)`` could not pick the phase: a parameter's hit in the forward read
    the value after the optimizer step."""
    weight_checked_twice(tmp_path)
    dump = load(tmp_path)
    assert [e.phase for e in dump.tensors(6)] == ["forward", "optimizer"]
    default = dump.tensor("fc.weight")  # the latest entry, the one holding the value
    assert default.entry(6).phase == "optimizer" and np.isnan(default.value(6)).all()
    forward = dump.tensor("fc.weight", phase="forward")
    assert forward.stats(6) == {"posinf": 1, "nan": 0, "min": 1, "max": np.inf}
    with pytest.raises(DumpError, match="in its forward phase but not that value: the value "
                                        "dumped is the one of its optimizer phase"):  # fmt: skip
        forward.value(6)
    with pytest.raises(DumpError, match=r"lists 'fc\.weight' in the backward phase"):
        dump.tensor("fc.weight", phase="backward")


def _index_lines(path: Path) -> tuple[Path, list[bytes]]:
    index = path / "rank-0" / fmt.INDEX
    return index, index.read_bytes().splitlines(keepends=True)


def test_an_index_line_altered_to_fewer_bytes_is_said_as_that_line_not_as_a_cut_index(tmp_path):
    """Line 2 overwritten with shorter garbage, the later lines intact: the reader said the
    index "is cut short ... the steps after its last line are missing"."""
    _write(tmp_path, steps=(0, 1, 2, 3), values={"x": np.ones(3, dtype=np.float32)})
    index, lines = _index_lines(tmp_path)
    lines[1] = b'{"crc":"68 garbage###' + lines[1][40:]  # step 1's line, its file name intact
    index.write_bytes(b"".join(lines))
    dump = load(tmp_path)
    assert dump.broken == {(1, 0): f"{index} line 2: the line has no checksum"}
    assert dump.steps() == [0, 2, 3] and dump.meta["complete"] is True


def test_an_index_line_that_fails_its_checksum_is_not_trusted_for_its_step(tmp_path):
    """ "step":1 changed to "step":3 on its line: the step said broken was 3 (which a whole
    line lists), and step 1 went unnoticed. Which step the line listed is not known."""
    _write(tmp_path, steps=(0, 1, 2, 3), values={"x": np.ones(3, dtype=np.float32)})
    index, lines = _index_lines(tmp_path)
    lines[1] = lines[1].replace(b'"step":1,', b'"step":3,', 1)
    index.write_bytes(b"".join(lines))
    dump = load(tmp_path)
    assert dump.steps() == [0, 2, 3]
    assert dump.broken == {(-1, 0): f"{index} line 2 was altered (the line fails its "
                                    "checksum): which step it listed cannot be told (it reads "
                                    "as step 3)"}  # fmt: skip
    assert dump.meta["complete"] is False and dump.meta["reason_incomplete"] == dump.broken[-1, 0]


@pytest.mark.parametrize("index", [b"", b'{"hello": [1,2', b"this is not json at all\n"])
def test_meta_complete_is_false_when_the_index_is_cut_empty_or_nonsense(tmp_path, index):
    """``meta["complete"]`` said True where ``check --json`` said false."""
    _write(tmp_path, steps=(0, 1), values={"x": np.ones(3, dtype=np.float32)})
    (tmp_path / "rank-0" / fmt.INDEX).write_bytes(index)
    dump = load(tmp_path)
    assert dump.meta["complete"] is False
    assert dump.meta["reason_incomplete"] == dump.broken[-1, 0]


def test_a_full_disk_is_recorded_as_why_the_dump_is_incomplete(tmp_path, monkeypatch):
    """On a full disk no file can be written, meta.json's new copy included: the dump said
    "the run did not finish" where writing had stopped on the disk."""
    values = {"x": np.ones(3, dtype=np.float32)}
    writer = DumpWriter(tmp_path, {"run_id": "r1"})
    writer.write_step(0, 0, _entries(values), values, [])

    def full(path, chunks, **how):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fmt, "write_atomic", full)
    with pytest.raises(OSError):
        writer.write_step(1, 0, _entries(values), values, [])
    reason = "writing step 1 failed ([Errno 28] No space left on device); later steps are missing"
    writer.fail(reason)
    writer.close(complete=False)
    dump = load(tmp_path)
    assert dump.meta["complete"] is False and dump.meta["reason_incomplete"] == reason
    assert dump.steps() == [0] and dump.broken == {}


def test_a_dump_dir_that_is_a_file_is_said_to_be_one(tmp_path):
    """``--dump-dir afile`` said "File exists"."""
    from tensordbg.dump.writer import unwritable_reason

    afile = tmp_path / "afile"
    afile.write_text("")
    assert (
        unwritable_reason(afile) == "it is a file, not a directory (give a directory for the dump)"
    )
    with pytest.raises(FileExistsError, match="afile is a file, not a directory"):
        DumpWriter(afile)


def test_an_entry_without_values_or_statistics_says_so_instead_of_blanks(tmp_path):
    """A gradient the run judged from another tensor's without keeping it is dumped with only
    whether it is finite: the replay said "only the statistics were dumped" and showed a row
    of dashes. The entry says what is known of it."""

    def entry(name, **stats):
        return {"name": name, "module": "head", "phase": "backward", "kind": "grad_output",
                "shape": [16, 4], "dtype": "float32", "stats": stats}  # fmt: skip

    writer = DumpWriter(tmp_path, {"run_id": "r1"})
    writer.write_step(5, 0, [entry("head.grad_output", finite=0.0),
                             entry("mid.grad_output", finite=1.0), entry("enc.grad_output"),
                             entry("low.grad_output", finite=0.0, nan=4.0),
                             entry("out.grad_output", finite=0.0)],
                      {"out.grad_output": np.zeros((16, 4), np.float32)}, [])  # fmt: skip
    writer.close()
    said = {e.name: e.nothing_to_show for e in load(tmp_path).tensors(5)}
    assert said == {
        "head.grad_output": "neither the values of head.grad_output nor its statistics were "
        "dumped at step 5: the run knew only that it holds NaN or Inf, not how many or where",
        "mid.grad_output": "neither the values of mid.grad_output nor its statistics were "
        "dumped at step 5: the run knew only that it is finite",
        "enc.grad_output": "neither the values of enc.grad_output nor its statistics were "
        "dumped at step 5: the run measured nothing of it",
        "low.grad_output": "",  # its NaN counted
        "out.grad_output": "",  # its values dumped
    }


def test_one_ranks_unreadable_metadata_loses_that_rank_alone(tmp_path: Path) -> None:
    """rank-1/meta.json overwritten: every rank was unreadable, the intact rank 0 too (load,
    replay --rank 0, diff). Now rank 0 opens, and the dump says what was lost."""
    import shutil

    from dumps import write_dump

    from tensordbg.offline.check import check_dump

    dump = write_dump(tmp_path / "d")
    shutil.copytree(dump / "rank-0", dump / "rank-1")
    (dump / "rank-1" / "meta.json").write_text("garbage")
    opened = load(dump)
    assert opened.ranks == [0] and opened.steps(0)
    assert opened.meta["complete"] is False
    assert (
        "rank-1/meta.json cannot be read as the dump's metadata" in opened.meta["reason_incomplete"]
    )
    assert check_dump(opened).exit_code == 1  # its NaN is still found
    (dump / "rank-0" / "meta.json").write_text("garbage")  # no rank left: one sentence
    with pytest.raises(DumpError, match="cannot be read as the dump's metadata"):
        load(dump)
