#!/usr/bin/env python3
"""Benchmark: bench's SseReader time per byte stays flat with the line length and the feed size.

A hostile server can send one long SSE line in tiny pieces; the reader must stay linear (no
rescan of the partial line on every feed). Prints microseconds per byte for lines of 1 KB to
4 MB fed in 1-byte, 1 KB and 64 KB pieces, and the ratio of the largest to the smallest line
(about 1 when linear). Run: PYTHONPATH=. .venv/bin/python scripts/bench_sse_reader.py
"""

from __future__ import annotations

import time

from cluster.serving.bench import SseReader


def _per_byte(line_bytes: int, piece: int) -> float:
    data = b'data: {"choices": [{"text": "' + b"x" * line_bytes + b'"}]}\n\ndata: [DONE]\n\n'
    pieces = [data[i:i + piece] for i in range(0, len(data), piece)]
    reader = SseReader()
    start = time.perf_counter()
    for part in pieces:
        reader.feed(part)
    elapsed = time.perf_counter() - start
    assert reader.done and reader.content_chunks == 1
    return elapsed / len(data) * 1e6


def main() -> None:
    sizes = (1_000, 64_000, 1_000_000, 4_000_000)
    for piece in (1, 1024, 65536):
        times = [_per_byte(size - 64, piece) for size in sizes]
        row = "  ".join(f"{size:>9,} B: {t:7.3f} us/B" for size, t in zip(sizes, times))
        print(f"pieces of {piece:>5} B  {row}  ratio 4MB/1KB {times[-1] / times[0]:.2f}")


if __name__ == "__main__":
    main()
