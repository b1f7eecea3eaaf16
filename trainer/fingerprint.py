"""A number identifying the set of token sequences trained on in a step.

Each sequence hashes to a 64-bit integer (a weighted sum of its tokens with fixed pseudo-random
weights, wrapping modulo 2**64); a step's fingerprint is the wrapping sum over its sequences. The sum
does not depend on the order of sequences, so it is the same however a global batch is split across
ranks and micro-batches, and it is cheap enough to compute for every step on the host.
"""

from __future__ import annotations

import numpy as np
import torch

_WEIGHTS: dict[int, tuple[np.ndarray, int, int]] = {}  # by window length: see _weights


def _weights(length: int) -> tuple[np.ndarray, int, int]:
    """The fixed odd weights of a window of ``length`` tokens: (those of all but the last token, the last one's,
    their sum)."""
    parts = _WEIGHTS.get(length)
    if parts is None:
        g = torch.Generator().manual_seed(0x5EED)
        w = (torch.randint(1, 2**31 - 1, (length,), generator=g, dtype=torch.int64) * 2 + 1).numpy()
        parts = _WEIGHTS[length] = (w[:-1], int(w[-1]), wrap_int64(sum(w.tolist())))
    return parts


def sequence_fingerprint(inputs, labels) -> int:
    """Wrapping sum of per-sequence hashes of [input tokens..., last label] for a [B, S] batch (numpy
    arrays or CPU tensors). Computed in numpy int64, which wraps like torch's, so the training thread never
    reads a tensor through torch's dispatcher."""
    inputs, labels = np.asarray(inputs), np.asarray(labels)
    if inputs.dtype != np.int64:
        inputs = inputs.astype(np.int64)
    return split_fingerprint(inputs, labels[:, -1])


def split_fingerprint(inputs: np.ndarray, last: np.ndarray) -> int:
    """The fingerprint from int64 inputs [B, S] and the last label of each sequence [B] (the windows without
    being put together: the wrapping sums are the same in any order)."""
    head, w_last, w_sum = _weights(inputs.shape[1] + 1)
    # Per sequence sum((t + 1) * w) = sum(t * w) + sum(w), modulo 2**64: the inputs' terms in one einsum
    # (integer arrays wrap without a warning), the last label's and sum(w) added in Python, wrapped to int64.
    # Then the per-sequence values v are mixed, v * c + (v >> 29), so that equal token multisets in different
    # sequences differ, and summed modulo 2**64 (in Python on the few values: cheaper than numpy calls on tiny
    # arrays).
    total = 0
    for d, t in zip(np.einsum("ij,j->i", inputs, head).tolist(), np.asarray(last).tolist()):
        v = wrap_int64(d + t * w_last + w_sum)
        total += v * 0x9E3779B1 + (v >> 29)
    return wrap_int64(total)


def wrap_int64(value: int) -> int:
    """``value`` modulo 2**64 as a signed int64 (what collectives carry); sums of fingerprints wrap too."""
    return (value + 2**63) % 2**64 - 2**63
