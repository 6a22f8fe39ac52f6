"""Tier-3 read bandwidth by destination buffer: what `new_block_buffer` (huge pages) buys over
4 KiB pages, and why bench/offload.py's `LinkProbe` reads each block into its own buffer.

    python bench/tier3_reads.py [--block-mb 25] [--file-mb 1024] [--reps 6]    # ~1 min

Writes a scratch file of random bytes (in $FT_BENCH_DIR or the system temp dir), then reads
random block-sized, 4 KiB-aligned ranges of it with O_DIRECT, one read at a time as
`BlockReader` does, into:
  4k_fresh    anonymous mappings on 4 KiB pages, faulted in (the reader's buffers before), made
              first, from memory nobody used yet
  4k_reused   the same, made after the process freed every other page of `--churn-mb` (what a
              long-running process gets back: scattered pages)
  huge_pages  `new_block_buffer` (transparent huge pages where the kernel grants them), made
              after the churn too
  one_buffer  a single huge-page buffer, read into over and over (what `LinkProbe` used to do)
Each rep runs every case once, in a shuffled order, over a rotating set of 8 buffers (except
one_buffer); medians are printed with ratios against 4k_reused measured in the same run.
Linux only (O_DIRECT).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def four_k_buffer(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    buf.madvise(mmap.MADV_NOHUGEPAGE)  # populated already: 4 KiB pages whatever the THP mode
    return buf


def read_gbps(fd: int, buffers: list[mmap.mmap], block: int, file_size: int, reads: int) -> float:
    """GB/s of `reads` O_DIRECT reads of random 4 KiB-aligned blocks, into `buffers` in turn."""
    offsets = [random.randrange(0, (file_size - block) // 4096) * 4096 for _ in range(reads)]
    t0 = time.perf_counter()
    for i, off in enumerate(offsets):
        os.preadv(fd, [buffers[i % len(buffers)]], off)
    return reads * block / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--block-mb", type=float, default=25.0, help="read size (a Mixtral-shaped fp32 block)")
    ap.add_argument("--file-mb", type=int, default=1024, help="scratch file size")
    ap.add_argument("--reps", type=int, default=6, help="repetitions (medians are reported)")
    ap.add_argument("--churn-mb", type=int, default=2048, help="memory freed page by page first")
    args = ap.parse_args()
    if args.reps < 1 or args.block_mb <= 0 or args.file_mb < 2 * args.block_mb:
        ap.error("need --reps >= 1, --block-mb > 0 and --file-mb at least twice --block-mb")
    if not hasattr(os, "O_DIRECT"):
        print("O_DIRECT is not available on this system", file=sys.stderr)
        return 2
    from freetoken_agents.engine.memory import new_block_buffer

    block = int(args.block_mb * (1 << 20)) // 4096 * 4096
    with tempfile.TemporaryDirectory(prefix="ft-tier3-", dir=os.environ.get("FT_BENCH_DIR")) as tmp:
        path = Path(tmp) / "scratch.bin"
        with open(path, "wb") as f:
            for _ in range(args.file_mb):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            fresh = [four_k_buffer(block) for _ in range(8)]
            churn = four_k_buffer(args.churn_mb << 20)
            for off in range(0, len(churn), 2 * mmap.PAGESIZE):  # free every other page
                churn.madvise(mmap.MADV_DONTNEED, off, mmap.PAGESIZE)
            huge = [new_block_buffer(block) for _ in range(8)]
            cases = {
                "4k_fresh": fresh,
                "4k_reused": [four_k_buffer(block) for _ in range(8)],
                "huge_pages": huge,
                "one_buffer": huge[:1],
            }
            rates: dict[str, list[float]] = {c: [] for c in cases}
            for _ in range(args.reps):
                for name in random.sample(list(cases), len(cases)):
                    rates[name].append(read_gbps(fd, cases[name], block, size, 12))
        finally:
            os.close(fd)
    base = statistics.median(rates["4k_reused"])
    print(f"O_DIRECT reads of {block / 1e6:.1f} MB, one at a time, medians of {args.reps} reps:")
    for name, v in rates.items():
        med = statistics.median(v)
        per_rep = [round(x, 2) for x in v]
        print(f"  {name:10s} {med:.2f} GB/s ({med / base:.2f}x 4k_reused)  per rep {per_rep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
