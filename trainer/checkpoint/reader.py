"""Reading a checkpoint's tensors: DCP's ``FileSystemReader`` with two changes that make a verified load
cost one pass over the files.

* Each file's items are read in the order they lie on disk, through a hashing stream
  (:func:`trainer.checkpoint.integrity.verifying_filesystem`), so the checksum of a file comes from the
  bytes the load reads (the parts this rank does not read are read when the file is closed).
* A whole stored tensor of the dtype and shape of its destination is read straight into the live CPU
  tensor; DCP's own reader ``torch.load``s it into a new tensor and copies that. Anything else (a shard
  of another layout, another dtype, a GPU destination, a transformed item) is read DCP's way.

With DCP's own ``read_data`` the same verified load took 2.4-4 times as long (1 GB, page cache dropped).
Where each item lies comes from :mod:`trainer.checkpoint.dcp_compat`; the rest is public API (the
``StorageReader`` methods, ``torch.load``, the zip format of ``torch.save``).
"""

from __future__ import annotations

import dataclasses
import io
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.dcp_compat import StoredItem, stored_items
from trainer.checkpoint.integrity import verifying_filesystem
from trainer.errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip member's local header: signature ... name and extra lengths


def checkpoint_entries(path: Path) -> dict[str, Any]:
    """``{flattened DCP key: its metadata}`` of a checkpoint (nothing but ``.metadata`` is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    return dict(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


class _Slice(io.RawIOBase):
    """The bytes [offset, offset + length) of a stream, as a stream of their own (one DCP item)."""

    def __init__(self, stream, offset: int, length: int):
        self.stream, self.offset, self.length = stream, offset, length
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = pos if whence == io.SEEK_SET else (self.pos + pos if whence == io.SEEK_CUR else self.length + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")[:max(0, self.length - self.pos)]
        if not len(view):
            return 0
        self.stream.seek(self.offset + self.pos)
        n = self.stream.readinto(view) or 0
        self.pos += n
        return n


def _storage_record(item: _Slice) -> tuple[int, int] | None:
    """(offset, size) of the bytes of the only storage in a one-tensor ``torch.save`` zip (its member
    ``<archive>/data/<key>``, stored uncompressed), or None when the item is not one. Read from the zip's
    central directory and the member's local header (the zip format, with the standard library)."""
    item.seek(0)
    with zipfile.ZipFile(item) as archive:  # reads the central directory only
        records = [m for m in archive.infolist() if m.filename.split("/")[-2:-1] == ["data"]]
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
        return None
    member = records[0]
    item.seek(member.header_offset)
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(item.read(_LOCAL_HEADER.size))
    if signature != b"PK\x03\x04":
        return None
    return member.header_offset + _LOCAL_HEADER.size + name_len + extra_len, member.file_size


def _read_into(item: _Slice, req, target: torch.Tensor) -> bool:
    """Read a whole stored tensor's bytes straight into ``target`` (a contiguous CPU tensor of the same dtype
    and shape), skipping ``torch.load``'s own buffer and the copy out of it. False, with nothing read into
    ``target``, when the item is not such a tensor (a shard of it, another dtype, another device)."""
    if target.device.type != "cpu" or not target.is_contiguous() or any(req.storage_offsets):
        return False
    item.seek(0)
    meta = torch.load(item, map_location="meta", weights_only=True)  # the zip's directory and header only
    if (not isinstance(meta, torch.Tensor) or meta.dtype != target.dtype
            or tuple(meta.shape) != tuple(target.shape) or tuple(req.lengths) != tuple(meta.shape)
            or not meta.is_contiguous() or meta.storage_offset() != 0):
        return False
    nbytes = target.numel() * target.element_size()
    record = _storage_record(item)
    if record is None or record[1] != nbytes:
        return False
    dst = memoryview(target.view(-1).view(torch.uint8).numpy())
    item.seek(record[0])
    done = 0
    while done < len(dst):
        n = item.readinto(dst[done:])
        if not n:
            raise OSError(f"{item.length}-byte item ends before its {len(dst)}-byte tensor (the file is truncated)")
        done += n
    return True


def _read_item(stream, where: StoredItem, req, planner) -> None:
    """One DCP read request: bytes to the planner, a tensor read into its place in the live state."""
    from torch.distributed.checkpoint.planner import LoadItemType

    item = _Slice(stream, where.offset, where.length)
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(item.read()))
        return
    target = planner.resolve_tensor(req).detach()
    if not _read_into(item, req, target):
        item.seek(0)
        tensor = torch.load(item, map_location="cpu", weights_only=True)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            if length < tensor.size(dim):
                tensor = tensor.narrow(dim, start, length)
        if tensor.size() != target.size():
            raise CheckpointError(f"{req.storage_index.fqn}: stored {tuple(tensor.size())}, expected "
                                  f"{tuple(target.size())}")
        target.copy_(tensor)
    planner.commit_tensor(req, target)


def checkpoint_reader(path: Path, algo: str, names: set[str]):
    """A DCP storage reader of the checkpoint ``path`` (see the module's docstring) that hashes the files of
    ``names`` with ``algo`` from the bytes it reads. Returns (reader, ``{name: (size, digest)}``, filled
    as the files are closed)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.futures import Future

    class CheckpointReader(FileSystemReader):
        items: dict[Any, StoredItem] = {}

        def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self.items = stored_items(metadata.storage_data)

        def prepare_local_plan(self, plan):
            def where(req):
                item = self.items[req.storage_index]
                return item.file, item.offset

            return dataclasses.replace(plan, items=sorted(plan.items, key=where))

        def read_data(self, plan, planner):
            if any(self.items[req.storage_index].transformed for req in plan.items):
                return super().read_data(plan, planner)  # compressed or otherwise transformed: DCP's own way
            by_file: dict[str, list] = {}
            for req in plan.items:
                by_file.setdefault(self.items[req.storage_index].file, []).append(req)
            for name, reqs in by_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                    for req in reqs:
                        _read_item(stream, self.items[req.storage_index], req, planner)
            done: Future = Future()
            done.set_result(None)
            return done

    reader = CheckpointReader(str(path))
    reader.fs, hashed = verifying_filesystem(reader.fs, algo, names)
    return reader, hashed
