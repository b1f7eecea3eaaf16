"""Checkpoint I/O without extra passes: files are hashed from the bytes DCP reads while loading (whatever order
it reads them in, and still catching a flipped bit in bytes it does not read), whole tensors are read in
place, the zip CRC is skipped on the writer's thread only, every file is verified by exactly one rank, and
``trainer bench checkpoint``'s disk table has every row. One process, small models."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import integrity
from trainer.checkpoint.integrity import file_checksum, share
from trainer.tools.bench import DEFAULT_CONFIG, checkpoint_disk

SIZE = "debugmodel_1l"  # the debug model with one layer: a ~10 MB checkpoint with optimizer state


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_hashing_reader_hashes_the_whole_file_whatever_the_read_order(tmp_path):
    path = tmp_path / "f.bin"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    want = file_checksum(path, "xxh3_128")
    # Reads as torch.load makes them in a DCP item (the zip directory at the end first, then headers, skips
    # and the data), a read behind the hashed prefix, and a part never read (hashed at finish).
    pattern = [(0, 8), (len(data) - 4096, 4096), (len(data) - 5000, 400), (8, 30), (100, 20), (130, 1 << 20),
               (50, 10), ((1 << 20) + 200, 1000), ((2 << 20), 4096)]
    with open(path, "rb") as raw:
        reader = integrity._HashingReader(raw, integrity.new_hasher("xxh3_128"))
        for start, n in pattern:
            reader.seek(start)
            assert reader.read(n) == data[start:start + n]
        assert reader.finish() == want


def test_hashing_writer_hashes_every_byte_in_order(tmp_path):
    """Large writes are hashed on a helper thread while they are written, small ones inline: the checksum
    is the file's, whatever the mix."""
    path = tmp_path / "f.bin"
    chunks = [os.urandom(n) for n in (10, integrity.OVERLAP, 3, 2 * integrity.OVERLAP + 1, 7)]
    with open(path, "wb") as raw:
        stream = integrity._HashingStream(raw, integrity.new_hasher("xxh3_128"))
        for c in chunks:
            assert stream.write(memoryview(c)) == len(c)
        stream.close()
        assert stream._pool is None  # the helper thread is gone
    assert path.read_bytes() == b"".join(chunks)
    assert (stream.size, stream.hasher.hexdigest()) == file_checksum(path, "xxh3_128")


def _trained_like(size: str = SIZE):
    return checkpoint_disk._build(size)


def _config(dump: Path, *extra: str):
    from trainer.tools.bench.common import load_bench_config

    ns = argparse.Namespace(config=str(DEFAULT_CONFIG))
    return load_bench_config(ns, [], ["--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0", *extra],
                             str(dump))


def test_load_verifies_from_the_bytes_it_reads(tmp_path, monkeypatch):
    """A load reads each data file once: what the hashing reader reads on its own is a small part of it."""
    model, optimizer = _trained_like()
    manager = checkpoint_disk._manager(_config(tmp_path), model, optimizer)
    assert manager.save(1)
    extra = {"bytes": 0}
    pread = integrity.os.pread

    def counting_pread(fd, n, offset):
        extra["bytes"] += n
        return pread(fd, n, offset)

    reread: list[str] = []
    checksum = integrity.file_checksum

    def recording_checksum(path, algo):
        reread.append(Path(path).name)
        return checksum(path, algo)

    monkeypatch.setattr(integrity.os, "pread", counting_pread)
    monkeypatch.setattr(integrity, "file_checksum", recording_checksum)
    manager.load()
    assert manager.loaded_step == 1
    data = (tmp_path / "checkpoint" / "step-1" / "__0_0.distcp").stat().st_size
    assert reread == ["dataloader.json"]  # the sidecar DCP does not read; the data file is not read again
    assert extra["bytes"] < data // 10, (extra, data)


@pytest.mark.parametrize("exclude", [[], ["optimizer"]], ids=["read", "not-read"])
def test_flipped_bit_is_caught_on_load_and_by_verify(tmp_path, exclude, capsys, caplog):
    """A byte changed in the newest checkpoint (in bytes the load reads, or in the optimizer's when it is
    excluded from loading): the load refuses it as CORRUPT and loads the previous checkpoint over it;
    ``trainer checkpoint verify`` names the file."""
    from trainer.checkpoint.cli import main as checkpoint_main

    model, optimizer = _trained_like()
    manager = checkpoint_disk._manager(_config(tmp_path), model, optimizer)
    assert manager.save(1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert manager.save(2)
    step2 = tmp_path / "checkpoint" / "step-2"
    marker = json.loads((step2 / "checkpoint.json").read_text())
    data = step2 / "__0_0.distcp"
    # A byte in the middle of a weight's or an optimizer moment's item.
    from torch.distributed.checkpoint import FileSystemReader

    items = FileSystemReader(str(step2)).read_metadata().storage_data
    prefix = "optimizer.state." if exclude else "model."
    info = max((v for k, v in items.items() if k.fqn.startswith(prefix)), key=lambda v: v.length)
    offset = info.offset + info.length // 2
    flip_byte(data, offset)
    assert checkpoint_main(["verify", str(tmp_path)]) == 3
    assert "step-2: __0_0.distcp fails its" in capsys.readouterr().out
    loader = checkpoint_disk._manager(_config(tmp_path, *sum((["--checkpoint.exclude_from_loading", e]
                                                               for e in exclude), [])), model, optimizer)
    with caplog.at_level("ERROR", logger="trainer"):
        loader.load()
    assert loader.loaded_step == 1
    assert "step-2 could not be loaded (CORRUPT: step-2/__0_0.distcp fails its" in caplog.text
    assert marker["files"]["__0_0.distcp"]["checksum"] in caplog.text
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_every_file_is_verified_by_exactly_one_rank():
    names = [".metadata", "dataloader.json", *(f"__{r}_{i}.distcp" for r in range(4) for i in range(2))]
    for world in (1, 2, 3, 4, 8):
        shares = [share(names, r, world) for r in range(world)]
        assert sorted(n for s in shares for n in s) == sorted(names)
        for r in range(world):
            assert all(int(n[2]) % world == r for n in shares[r] if n.endswith(".distcp"))


def test_bench_checkpoint_table_has_every_row(tmp_path):
    """``trainer bench checkpoint``'s disk part at a tiny size: every row for both checksum settings, and the
    results as JSON (the numbers are not checked: a benchmark, not a timed test)."""
    from trainer.tools.bench.report import format_table

    ns = argparse.Namespace(steps="small", checkpoint_sizes=f"{SIZE},llama3_405b", checkpoint_folder=str(tmp_path),
                            config=str(DEFAULT_CONFIG), checkpoint_repeats=1)
    result = checkpoint_disk.bench_checkpoint_disk(ns, [], str(tmp_path))
    json.loads(json.dumps(result))
    assert list(result["sizes"]) == [SIZE] and "llama3_405b" in result["skipped"]
    for algo in checkpoint_disk.ALGOS:
        m = result["sizes"][SIZE][algo]
        for _, key, _ in checkpoint_disk.ROW_KEYS:
            assert key in m
        assert m["sync_save_s"] > 0 and m["load_s"] > 0 and m["raw_write_gb_per_s"] > 0
    table = format_table({"checkpoint": {"disk": result, "async_mode": "async", "checkpoint_bytes": 1.0,
                                         "sync_save_s": 1.0, "async_blocking_s": 0.1, "async_first_step_extra_s": 0.0,
                                         "async_block_fraction": 0.1, "async_write_s": 1.0,
                                         "sync_save_gb_per_s": 1.0, "async_save_gb_per_s": 1.0,
                                         "load_gb_per_s": 1.0, "step_time_s": 1.0,
                                         "step_time_during_async_write_s": 1.0}})
    for algo in checkpoint_disk.ALGOS:
        for name, _, _ in checkpoint_disk.ROW_KEYS:
            assert f"ckpt {SIZE}" in table and f", {algo}: {name}" in table, (algo, name)
    assert "sync save / raw write" in table and "target >= 0.7" in table and "target <= 0.05" in table
    assert "checkpoint llama3_405b" in table and "skipped" in table
    assert not list(Path(tmp_path).glob("checkpoint_disk/*"))  # cleaned up


def test_bench_staging_times_fresh_and_reused_copies_in_one_run():
    """``trainer bench checkpoint``'s staging part (alone: ``trainer bench staging``): a background save's copy
    with a fresh copy per save and with buffers reused from save to save (pinned on CUDA), each timed in the
    same run, alternately, and their ratio in the table (the numbers are not checked: a benchmark)."""
    import torch

    from trainer.tools.bench.report import format_table
    from trainer.tools.bench.staging import bench_staging

    s = bench_staging(argparse.Namespace(steps="small", checkpoint_repeats=1), [], "")
    assert s["pinned"] == torch.cuda.is_available() and abs(s["bytes"] - 2e7) < 1e5
    assert len(s["samples"]["fresh"]) == len(s["samples"]["reused"]) == 2
    assert s["reused_vs_fresh"] == s["reused_copy_s"] / s["fresh_copy_s"] and s["reused_first_copy_s"] > 0
    table = format_table({"staging": s})
    tag = f"staging 0.02 GB on {s['device']}"
    for row in ("fresh copy per save (s) [async]", "reused buffers (s) [async_with_pinned_mem",
                "reused / fresh copy time", "reused buffers, first copy (allocates)"):
        assert f"{tag}: {row}" in table, table
    assert ("not pinned: no CUDA" in table) != s["pinned"]


def test_save_threads_write_a_file_each_and_load(tmp_path):
    """checkpoint.save_threads = 2: two data files for the rank, both checksummed, loaded and verified."""
    model, optimizer = _trained_like()
    manager = checkpoint_disk._manager(_config(tmp_path, "--checkpoint.save_threads", "2"), model, optimizer)
    assert manager.save(1)
    marker = json.loads((tmp_path / "checkpoint" / "step-1" / "checkpoint.json").read_text())
    data = sorted(n for n in marker["files"] if n.endswith(".distcp"))
    assert data == ["__0_0.distcp", "__0_1.distcp"] and all(marker["files"][n]["checksum"] for n in data)
    flip_byte(tmp_path / "checkpoint" / "step-1" / "__0_1.distcp", 2000)
    assert manager.save(2)
    manager.load()
    assert manager.loaded_step == 2
    import shutil

    shutil.rmtree(tmp_path / "checkpoint" / "step-2")
    from trainer.errors import CheckpointError

    with pytest.raises(CheckpointError, match="CORRUPT: step-1/__0_1.distcp"):
        manager.load()


def _zip_crcs(data: bytes) -> list[int]:
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return [m.CRC for m in archive.infolist() if m.filename.split("/")[-2:-1] == ["data"]]


def test_zip_crc_is_off_only_on_the_writers_thread(tmp_path):
    """The checkpoint writer skips torch.save's zip CRC (the checkpoint's own checksum covers every byte),
    on its own thread and only while it writes: a torch.save on another thread meanwhile keeps its CRC,
    and so does one on the writer's thread afterwards."""
    import io
    import threading

    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.reader import _Slice, _storage_record
    from trainer.checkpoint.writer import new_writer, zip_crc32_off

    def saved(t: torch.Tensor) -> bytes:
        buf = io.BytesIO()
        torch.save(t, buf)
        return buf.getvalue()

    tensor = torch.arange(1000.0)
    inside, beside = threading.Event(), threading.Event()
    other: list[bytes] = []

    def other_thread():
        inside.wait(10.0)
        other.append(saved(tensor))
        beside.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with zip_crc32_off():
        inside.set()
        assert beside.wait(10.0)
        off = saved(tensor)
    thread.join()
    assert _zip_crcs(off) == [0]
    assert _zip_crcs(other[0])[0] != 0 and _zip_crcs(saved(tensor))[0] != 0
    # DCP's writer: every tensor record of the data file without a CRC; the bytes are those of the tensor.
    writer = new_writer(str(tmp_path / "ck"), checksum="xxh3_128", thread_count=1)
    dcp.save({"t": tensor}, storage_writer=writer, no_dist=True)
    assert set(writer.sums) == {"__0_0.distcp"}
    data = (tmp_path / "ck" / "__0_0.distcp").read_bytes()
    with open(tmp_path / "ck" / "__0_0.distcp", "rb") as stream:
        offset, size = _storage_record(_Slice(stream, 0, len(data)))
    assert size == tensor.numel() * 4 and data[offset:offset + size] == tensor.numpy().tobytes()
    assert _zip_crcs(data) == [0]
    assert _zip_crcs(saved(tensor))[0] != 0


def test_reader_reads_whole_tensors_in_place_and_the_rest_dcps_way(tmp_path, monkeypatch):
    """Whole stored tensors of the destination's dtype and shape (0-d ones too) are read straight into it;
    a bf16 tensor into a float32 destination goes through torch.load and a copy (DCP's way), other values
    through the planner. All bitwise, and the data file is verified from the bytes read."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint import reader
    from trainer.checkpoint.writer import new_writer

    torch.manual_seed(0)
    saved = {"w": torch.randn(64, 33), "ids": torch.arange(7), "step": torch.tensor(3.0),
             "half": torch.randn(5, 4).to(torch.bfloat16), "extra": {"lr": 0.5}}
    writer = new_writer(str(tmp_path), checksum="xxh3_128", thread_count=1)
    dcp.save(saved, storage_writer=writer, no_dist=True)
    in_place = []
    read_into = reader._read_into

    def spy(item, req, target):
        done = read_into(item, req, target)
        in_place.append((req.storage_index.fqn, done))
        return done

    monkeypatch.setattr(reader, "_read_into", spy)
    out = {"w": torch.zeros(64, 33), "ids": torch.zeros(7, dtype=torch.int64), "step": torch.tensor(0.0),
           "half": torch.zeros(5, 4), "extra": {"lr": 0.0}}
    storage_reader, hashed = reader.checkpoint_reader(tmp_path, "xxh3_128", {"__0_0.distcp"})
    dcp.load(out, storage_reader=storage_reader, no_dist=True)
    assert dict(in_place) == {"w": True, "ids": True, "step": True, "half": False}
    for key in ("w", "ids", "step"):
        assert torch.equal(out[key], saved[key]), key
    assert torch.equal(out["half"], saved["half"].float()) and out["extra"] == {"lr": 0.5}
    assert hashed["__0_0.distcp"][1] == writer.sums["__0_0.distcp"]["checksum"]
