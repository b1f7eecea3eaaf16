"""A number identifying the set of token sequences trained on in a step.

Each sequence hashes to a 64-bit integer (a weighted sum of its tokens with fixed pseudo-random
weights, wrapping modulo 2**64); a step's fingerprint is the wrapping sum over its sequences. The sum
does not depend on the order of sequences, so it is the same however a global batch is split across
ranks and micro-batches, and it is cheap enough to compute for every step on the host.
"""

from __future__ import annotations

import numpy as np
import torch

_WEIGHTS: dict[int, np.ndarray] = {}
_WEIGHT_SUMS: dict[int, np.int64] = {}
_SPLIT: dict[int, tuple] = {}  # split_fingerprint's weights by window length: all but the last, the last, the sum


def _weights(length: int) -> np.ndarray:
    if length not in _WEIGHTS:
        g = torch.Generator().manual_seed(0x5EED)
        weights = torch.randint(1, 2**31 - 1, (length,), generator=g, dtype=torch.int64) * 2 + 1
        _WEIGHTS[length] = weights.numpy()
        with np.errstate(over="ignore"):
            _WEIGHT_SUMS[length] = _WEIGHTS[length].sum()
    return _WEIGHTS[length]


def sequence_fingerprint(inputs, labels) -> int:
    """Wrapping sum of per-sequence hashes of [input tokens..., last label] for a [B, S] batch (numpy
    arrays or CPU tensors). Computed in numpy int64, which wraps like torch's, so the training thread never
    reads a tensor through torch's dispatcher."""
    inputs, labels = np.asarray(inputs), np.asarray(labels)
    if inputs.dtype != np.int64:
        inputs = inputs.astype(np.int64)
    return split_fingerprint(inputs, labels[:, -1])


def window_fingerprint(windows: np.ndarray) -> int:
    """The same fingerprint from the [B, S + 1] token windows a batch is cut from (inputs are [:, :-1], labels
    [:, 1:]): no copy when they are int64 already."""
    seqs = np.asarray(windows)
    if seqs.dtype != np.int64:
        seqs = seqs.astype(np.int64)
    w = _weights(seqs.shape[1])
    # sum((t + 1) * w) = sum(t * w) + sum(w), wrapping modulo 2**64 either way (einsum: one pass, no
    # temporary array; integer arrays wrap without a warning).
    return _mix(np.einsum("ij,j->i", seqs, w) + _WEIGHT_SUMS[seqs.shape[1]])


def split_fingerprint(inputs: np.ndarray, last: np.ndarray) -> int:
    """The same fingerprint from int64 inputs [B, S] and the last label of each sequence [B] (the windows
    without being put together: the wrapping sums are the same in any order)."""
    length = inputs.shape[1] + 1
    parts = _SPLIT.get(length)
    if parts is None:
        w = _weights(length)
        parts = _SPLIT[length] = (w[:-1], int(w[-1]), int(_WEIGHT_SUMS[length]))
    head, w_last, w_sum = parts
    # The few per-sequence values in Python: the last label's term and sum(w) added, each wrapped to int64.
    return _mix([wrap_int64(d + t * w_last + w_sum)
                 for d, t in zip(np.einsum("ij,j->i", inputs, head).tolist(), np.asarray(last).tolist())])


def _mix(per_seq) -> int:
    # Mix the per-sequence values (int64) so that equal token multisets in different sequences differ:
    # v * c + (v >> 29) of each v, summed modulo 2**64 (in Python on the few values: cheaper than numpy calls on
    # tiny arrays).
    total = 0
    for v in (per_seq.tolist() if isinstance(per_seq, np.ndarray) else per_seq):
        total += v * 0x9E3779B1 + (v >> 29)
    return wrap_int64(total)


def wrap_int64(value: int) -> int:
    """``value`` modulo 2**64 as a signed int64 (what collectives carry); sums of fingerprints wrap too."""
    return (value + 2**63) % 2**64 - 2**63
