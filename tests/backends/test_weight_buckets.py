"""Weight buckets (``backends.weight_buckets``): what goes in comes out, bit for bit, in order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlengine.backends.weight_buckets import pack, unpack


def tensors() -> list[tuple[str, object]]:
    g = torch.Generator().manual_seed(0)
    return [("emb", torch.randn(33, 7, generator=g)), ("bf16", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
            ("empty", torch.zeros(0, 4)), ("scalar", torch.tensor(2.5)), ("theta", np.arange(11, dtype=np.float32)),
            ("ints", np.arange(6, dtype=np.int64).reshape(2, 3)), ("big", torch.randn(300, 40, generator=g)),
            ("strided", torch.randn(6, 4, generator=g).t())]


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1000, 1 << 30])
def test_buckets_round_trip_every_tensor_bitwise_in_order(bucket_bytes):
    named = tensors()
    blobs = pack(named, bucket_bytes)
    got = [item for blob in blobs for item in unpack(blob)]
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, have) in zip(named, got):
        assert type(have) is type(want) and have.dtype == want.dtype and tuple(have.shape) == tuple(want.shape)
        if isinstance(want, torch.Tensor):
            assert torch.equal(have, want)
            have.add_(0)  # owns writable memory
        else:
            assert np.array_equal(have, want)
    if bucket_bytes == 1:
        assert len(blobs) == len(named)  # one per tensor, none split
    if bucket_bytes == 1 << 30:
        assert len(blobs) == 1


def test_a_bad_bucket_or_tensor_is_refused_by_name():
    with pytest.raises(ValueError, match="bad magic"):
        unpack(b"NOPE" + bytes(16))
    with pytest.raises(TypeError, match="list"):
        pack([("x", [1.0, 2.0])], 64)
