"""Bounded keeping of a node's output: its head and its tail, the bytes between counted.

A tool that prints 160 MB must cost this machine a bounded amount of memory and log: a stream
is kept as its first and last `limit // 2` bytes, and where the middle was dropped the text
says so in one line, `cut_note(N)` ("[cluster: N bytes cut]"), which also reaches the node
logs. Readers of a cut output (the parsers, the checks) refuse to judge it.
"""

from __future__ import annotations

from collections import deque
from typing import Callable


def cut_note(count: int) -> str:
    """The line put where a stream's middle was cut."""
    return f"[cluster: {count} bytes cut]"


class HeadTail:
    """Bytes added in chunks; keeps the first and last `limit // 2` of them (memory O(limit),
    time O(input))."""

    def __init__(self, limit: int):
        self.half = max(1, limit // 2)
        self.head = bytearray()
        self.tail: deque[bytes] = deque()
        self.tail_size = 0
        self.cut = 0

    def add(self, data: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail.append(bytes(data))
        self.tail_size += len(data)
        while self.tail and self.tail_size - len(self.tail[0]) >= self.half:
            dropped = self.tail.popleft()
            self.tail_size -= len(dropped)
            self.cut += len(dropped)

    def text(self, decode: Callable[[bytes], str]) -> str:
        """What was kept, decoded once (a character split across chunks stays whole)."""
        tail = b"".join(self.tail)
        if len(tail) > self.half:
            self.cut += len(tail) - self.half
            tail = tail[len(tail) - self.half:]
            self.tail, self.tail_size = deque([tail]), len(tail)
        if not self.cut:
            return decode(bytes(self.head) + tail)
        return decode(bytes(self.head)) + "\n" + cut_note(self.cut) + "\n" + decode(tail)
