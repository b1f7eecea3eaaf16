"""The least a token-file loader written with numpy calls can cost, against plain memmap slicing.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/measure_loader_floor.py [--seq-lens 4096,8192] [--seconds 1.5] \
        [--json outputs/loader_floor.json]

The files and the plain-slicing contender are those of ``trainer bench data-files`` (the same documents,
mean 1,024 tokens; micro-batches of 4 windows). Each numpy call the loader has to make per token is timed on
its own, with every Python step around it done beforehand, so the sum is a floor for any loader that
makes these calls, whatever its bookkeeping:

* *block*: per block of ``data.shuffle_window`` documents, the seeded permutation, the vocabulary check (the
  largest id of the stretch holding them) and the layout (lengths and starts in reading order, their cumulative
  sums), spread over the block's micro-batches;
* *pack*: the documents copied, in shuffled order, into the micro-batch's rows (one ``np.concatenate`` per
  window, its slices made beforehand);
* *widen*: inputs and labels as int64 copies of the rows;
* *fingerprint*: the micro-batch's fingerprint (trainer/fingerprint.py);
* *tensors*: inputs and labels as torch tensors.

"ceiling" is plain slicing's time over the floor: the most of plain's speed such a loader can reach.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH = 4
BLOCK_DOCS = 1024  # data.shuffle_window's default
VOCAB, EOS = 2048, 1  # the debug tokenizer's


def _per_call(fn, calls, seconds: float) -> float:
    """Seconds per call of ``fn(arg)`` over ``calls`` (cycled), best of two rounds."""
    best = float("inf")
    for _ in range(2):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            fn(calls[n % len(calls)])
            n += 1
        best = min(best, (time.perf_counter() - start) / n)
    return best


def _documents(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first Megatron file's tokens (memory-mapped) and its documents' starts and lengths."""
    from trainer.data.readers import read_megatron_index

    prefix = str(sorted(folder.glob("*.idx"))[0])[:-4]
    meta = read_megatron_index(prefix + ".idx")
    tokens = np.memmap(prefix + ".bin", dtype=meta["dtype"], mode="r").view(np.ndarray)
    return tokens, meta["pointers"] // tokens.itemsize, meta["lengths"].astype(np.int64)


def _windows(tokens, starts, lens, seq_len: int, count: int) -> list[list[np.ndarray]]:
    """The slices of ``count`` consecutive windows of seq_len + 1 tokens, documents in shuffled block order."""
    width = seq_len + 1
    order = np.concatenate([first + np.random.default_rng(first).permutation(min(BLOCK_DOCS, len(lens) - first))
                            for first in range(0, len(lens), BLOCK_DOCS)])
    out, parts, room, d = [], [], width, 0
    while len(out) < count:
        doc = int(order[d % len(order)])
        a, n = int(starts[doc]), int(lens[doc])
        while n:
            take = min(room, n)
            parts.append(tokens[a:a + take])
            a, n, room = a + take, n - take, room - take
            if not room:
                out.append(parts)
                parts, room = [], width
        d += 1
    return out


def measure(seq_len: int, folder: Path, plain_files: list[Path], seconds: float) -> dict:
    import torch

    from trainer.data.pipeline import _rng
    from trainer.fingerprint import split_fingerprint
    from trainer.tools.bench.data_files import _plain_rate

    tokens, starts, lens = _documents(folder)
    width = seq_len + 1
    windows = _windows(tokens, starts, lens, seq_len, 256 * BATCH)
    micro = [windows[i:i + BATCH] for i in range(0, len(windows), BATCH)]
    rows = np.empty((BATCH, width), dtype=tokens.dtype)

    def pack(batch):
        for row, parts in zip(rows, batch):
            np.concatenate(parts, out=row)

    blocks = list(range(0, len(lens) - BLOCK_DOCS, BLOCK_DOCS))

    def block(first):
        perm = _rng(0, 0, 0, 0, 0, first, 2).permutation(BLOCK_DOCS)
        span = tokens[int(starts[first]):int(starts[first + BLOCK_DOCS - 1] + lens[first + BLOCK_DOCS - 1])]
        assert int(span.max()) < VOCAB
        block_lens, block_starts = lens[first:first + BLOCK_DOCS][perm], starts[first:first + BLOCK_DOCS][perm]
        last = tokens[block_starts + block_lens - 1]
        return np.cumsum(block_lens).tolist(), block_starts.tolist(), (block_starts + block_lens).tolist(), \
            np.cumsum(last != EOS).tolist()

    samples = []  # (few: the loader widens rows it has just packed, and fingerprints what it has just widened)
    for batch in micro[:2]:
        pack(batch)
        samples.append(rows.copy())
    widened = [(s[:, :-1].astype(np.int64), s[:, 1:].astype(np.int64)) for s in samples]
    tokens_per_block = float(lens[:BLOCK_DOCS].sum())
    us = {
        "block": _per_call(block, blocks, seconds) * BATCH * width / tokens_per_block * 1e6,
        "pack": _per_call(pack, micro, seconds) * 1e6,
        "widen": _per_call(lambda s: (s[:, :-1].astype(np.int64), s[:, 1:].astype(np.int64)), samples, seconds) * 1e6,
        "fingerprint": _per_call(lambda w: split_fingerprint(w[0], w[1][:, -1]), widened, seconds) * 1e6,
        "tensors": _per_call(lambda w: (torch.from_numpy(w[0]), torch.from_numpy(w[1])), widened, seconds) * 1e6,
    }
    floor = sum(us.values())
    plain = max(_plain_rate(plain_files, seq_len, BATCH, seconds / 2) for _ in range(2))
    plain_us = BATCH * seq_len / plain * 1e6
    return {"seq_len": seq_len, **{f"{k}_us": v for k, v in us.items()}, "floor_us": floor, "plain_us": plain_us,
            "ceiling": plain_us / floor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="4096,8192")
    parser.add_argument("--seconds", type=float, default=1.5, help="per part measured")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    from trainer.tools.bench.data_files import write_token_files

    with tempfile.TemporaryDirectory() as tmp:
        paths = write_token_files(Path(tmp), 32 << 20, vocab=VOCAB, eos=EOS)
        plain_files = sorted(paths["numpy"].glob("*.npy"))
        rows = [measure(int(s), paths["megatron"], plain_files, args.seconds) for s in args.seq_lens.split(",")]
    parts = ("block", "pack", "widen", "fingerprint", "tensors", "floor", "plain")
    print(f"{'seq_len':>8}" + "".join(f"{p + ' us':>15}" for p in parts) + f"{'ceiling':>10}")
    for r in rows:
        print(f"{r['seq_len']:>8}" + "".join(f"{r[p + '_us']:>15.1f}" for p in parts) + f"{r['ceiling']:>10.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
