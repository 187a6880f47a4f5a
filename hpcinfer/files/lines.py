"""JSONL files -> numbered lines, in bounded chunks, whatever the length of a line.

A line may be longer than a chunk (a row of megabytes of text): its pieces are kept until its
newline (or the end of the file) comes, so "no complete line in this chunk" never ends the read.
A UTF-8 byte order mark at the start of the file is dropped; `\\r\\n` line ends are taken as `\\n`
(JSON treats the `\\r` as whitespace); blank lines are not rows. Every byte of the file is
accounted for: `LineSplitter.bytes_seen` must equal the file's size at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

BOM = b"\xef\xbb\xbf"
CHUNK_BYTES = 1 << 20


class LineSplitter:
    """Reads `fh` in chunks of about `chunk_bytes`; yields lists of (1-based line number, line bytes).

    Only non-blank lines are yielded; line numbers count every line, blank ones too, so they match
    what an editor shows. `rows` counts the non-blank lines yielded so far. `first_line` is the
    number of the line `fh` is positioned at (a reader of a range of the file seeks to a line's
    start); a byte order mark is only looked for at line 1.
    """

    def __init__(self, fh: BinaryIO, chunk_bytes: int = CHUNK_BYTES, first_line: int = 1) -> None:
        self.fh = fh
        self.chunk_bytes = max(1, chunk_bytes)
        self.bytes_seen = 0  # bytes read and assigned to a line (newlines and the BOM included)
        self.rows = 0
        self._line_no = first_line - 1

    def chunks(self) -> Iterator[list[tuple[int, bytes]]]:
        pieces: list[bytes] = []  # the current, unfinished line: it has no newline yet
        for data in self._reads():
            cut = data.rfind(b"\n")
            if cut < 0:  # no newline in this chunk: the line goes on
                pieces.append(data)
                continue
            pieces.append(data[: cut + 1])
            yield self._numbered(b"".join(pieces).split(b"\n")[:-1], ended=True)
            pieces = [data[cut + 1 :]] if cut + 1 < len(data) else []
        last = b"".join(pieces)
        if last:  # a final line without a newline
            yield self._numbered([last], ended=False)

    def _reads(self) -> Iterator[bytes]:
        """The file's bytes in chunks, less a leading byte order mark."""
        data = self.fh.read(max(self.chunk_bytes, len(BOM)))
        if self._line_no == 0 and data.startswith(BOM):
            self.bytes_seen += len(BOM)
            data = data[len(BOM) :] or self.fh.read(self.chunk_bytes)
        while data:
            yield data
            data = self.fh.read(self.chunk_bytes)

    def _numbered(self, lines: list[bytes], *, ended: bool) -> list[tuple[int, bytes]]:
        first = self._line_no
        self._line_no += len(lines)
        self.bytes_seen += sum(len(line) for line in lines) + (len(lines) if ended else 0)
        numbered = [(first + i + 1, line) for i, line in enumerate(lines) if line.strip()]
        self.rows += len(numbered)
        return numbered
