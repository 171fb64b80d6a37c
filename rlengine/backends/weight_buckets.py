"""Named weight tensors as self-describing byte buckets: how weights cross a process boundary.

A weight sync to remote sampler replicas (``Placement(kind="ray")``) sends the
trainer's named tensors as a few large byte buffers (``bytearray``) rather than one
message per tensor, and as plain bytes rather than pickled objects. A bucket
is::

    b"RLWB" | u32 header length | msgpack header | zero padding to 64 | tensor bytes

where the header lists ``(name, dtype, shape, offset, nbytes)`` per tensor
(``offset`` from the start of the data), ``dtype`` as ``"numpy:<name>"`` or
``"torch:<name>"`` (torch's own dtypes, bfloat16 included, go as raw bytes).
``pack`` fills buckets of about ``bucket_bytes`` each, in the order given
(a tensor larger than that gets a bucket of its own; none is split);
``unpack`` returns the tensors of one bucket as the kind that went in, each
owning its memory. Torch is imported only for torch tensors.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

__all__ = ["pack", "unpack"]

_MAGIC = b"RLWB"
_ALIGN = 64
_header = msgspec.msgpack.Encoder()
_read_header = msgspec.msgpack.Decoder(list[tuple[str, str, list[int], int, int]])


def _raw(tensor: Any) -> tuple[str, list[int], memoryview]:
    """(dtype tag, shape, bytes) of a numpy array or a torch tensor (moved to the CPU)."""
    if isinstance(tensor, np.ndarray):
        array = np.ascontiguousarray(tensor)
        return f"numpy:{array.dtype.str}", list(array.shape), memoryview(array).cast("B")
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weight bucket: expected a numpy array or a torch tensor, got {type(tensor).__name__}")
    t = tensor.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return f"torch:{name}", list(t.shape), memoryview(data).cast("B")


def _bucket(entries: list[tuple[str, str, list[int], memoryview]]) -> bytearray:
    header, offset = [], 0
    for name, dtype, shape, data in entries:
        header.append((name, dtype, shape, offset, data.nbytes))
        offset += -(-data.nbytes // _ALIGN) * _ALIGN
    head = _header.encode(header)
    start = -(-(8 + len(head)) // _ALIGN) * _ALIGN
    out = bytearray(start + offset)
    out[:8] = _MAGIC + struct.pack("<I", len(head))
    out[8:8 + len(head)] = head
    for (_, _, _, data), (_, _, _, at, n) in zip(entries, header):
        out[start + at:start + at + n] = data
    return out  # not bytes(out): that copies the whole bucket again (45 ms per 96 MB, measured)


def pack(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> list[bytearray]:
    """The tensors in buckets of about ``bucket_bytes`` each (module docstring)."""
    buckets: list[bytearray] = []
    entries: list[tuple[str, str, list[int], memoryview]] = []
    size = 0
    for name, tensor in named_tensors:
        dtype, shape, data = _raw(tensor)
        if entries and size + data.nbytes > bucket_bytes:
            buckets.append(_bucket(entries))
            entries, size = [], 0
        entries.append((name, dtype, shape, data))
        size += data.nbytes
    if entries:
        buckets.append(_bucket(entries))
    return buckets


def unpack(blob: bytes | bytearray | memoryview) -> list[tuple[str, Any]]:
    """The named tensors of one bucket, each a numpy array or torch tensor owning its memory."""
    view = memoryview(blob).cast("B")
    if view[:4] != _MAGIC:
        raise ValueError("weight bucket: bad magic (not a bucket from rlengine.backends.weight_buckets.pack)")
    (length,) = struct.unpack("<I", view[4:8])
    header = _read_header.decode(view[8:8 + length])
    start = -(-(8 + length) // _ALIGN) * _ALIGN
    out: list[tuple[str, Any]] = []
    for name, dtype, shape, offset, nbytes in header:
        kind, _, type_name = dtype.partition(":")
        data = view[start + offset:start + offset + nbytes]
        if kind == "numpy":
            out.append((name, np.frombuffer(data, dtype=np.dtype(type_name)).reshape(shape).copy()))
        elif kind == "torch":
            import torch

            tdtype = getattr(torch, type_name)
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if nbytes else torch.zeros(0, dtype=torch.uint8)
            out.append((name, raw.view(tdtype).reshape(shape)))
        else:
            raise ValueError(f"weight bucket: tensor {name!r} has unknown dtype tag {dtype!r}")
    return out
