"""Where a file is cut into chunks.

Fixed-size cuts would let one changed tensor shift or straddle the chunks of its unchanged neighbours.
So large tensors (records of a torch zip, tensors of a safetensors file) start and end on a cut, and
only the small records between them share chunks: a checkpoint in which most tensors are unchanged
then shares most chunks with its predecessor. No chunk exceeds `chunk_size`.

Big zip members are cut LEAD bytes after their start and TAIL bytes before their end instead
(`record_cuts`), for `torch.load(mmap=True)`: it reads the local header of every storage record, also
of the tensors the caller never touches, through a buffered file, so the kernel asks for the page that
holds the header (and the last bytes of the record before it) up to READ_BLOCK (the mount's
st_blksize) past it. Cut at the records' ends, that read took the record's first chunk and the
previous record's last, and reading the headers fetched most of the file (4.8x the bytes read to load
the weights of a training checkpoint). Now it falls in one small chunk: the previous member's last
TAIL bytes (a page), its data descriptor, the local header and the member's first LEAD bytes
(READ_BLOCK and a page), ~24 KiB. That is as many chunks as cuts at the ends gave (the header had a
tiny chunk of its own); a chunk of its own for the first LEAD bytes instead cost the daemon ~50% more
CPU loading a checkpoint of 0.5-2 MiB tensors. The price: those ~24 KiB per member dedup only along
with the local header, so not when the member's name changes (torch.save names the archive after the
file, and numbers the storages in pickle order). Safetensors readers read no per-tensor header: its
tensors keep their cuts at start and end. Only when chunk_size/8 > LEAD + TAIL (chunk_size above
192 KiB; 4 MiB by default), so that every big member has room for both cuts.

The cut points come from the file's tensor index when it has one (`tensor_boundaries`). A
BoundaryScanner finds the same points from the bytes alone, in file order, so a file being written
can be cut before its index exists (the zip directory comes last); it is also the fallback for a file
without an index, such as a zip whose pickle the indexer rejects. `cut_points` picks between the two:
`cpfs put` and files written through the mount both call it, so the same bytes give the same chunks.
"""
from __future__ import annotations

import bisect
import copy
import json
import struct
from collections.abc import Callable, Iterable, Sequence

from .tensor_index import MAX_PICKLE, MAX_SAFETENSORS_HEADER, TensorIndex, storage_sizes, zip64_extra

ReadAt = Callable[[int, int], bytes]

_INF = 1 << 62                     # beyond any file
_U32 = 0xFFFFFFFF
_LOCAL = b"PK\x03\x04"             # zip local file header
_DESCRIPTOR = b"PK\x07\x08"        # zip data descriptor
_CENTRAL = b"PK\x01\x02"          # central directory entry
_END64 = b"PK\x06\x06"            # zip64 end record
_END = b"PK\x05\x06"              # end of central directory
_AFTER_MEMBER = (_LOCAL, _CENTRAL, _END, _END64)
_ZIP_END = {_CENTRAL: 46, _END64: 12, b"PK\x06\x07": 20, _END: 22}   # what ends a zip: fixed sizes
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_SCAN_BLOCK = 1 << 20

PAGE = 4096
READ_BLOCK = 16 * 1024             # the mount's st_blksize (files not being written): a buffered read
LEAD = READ_BLOCK + PAGE           # a big zip member's bytes that share its header's chunk
TAIL = PAGE                        # ... and the previous member's


def record_cuts(offset: int, length: int, chunk_size: int, member: bool) -> tuple[int, ...]:
    """The cut points a record of `length` bytes at `offset` adds: none below chunk_size/8; else its
    start and end, or for a zip member (`member`) start + LEAD and end - TAIL (see the module doc)."""
    min_len = max(1, chunk_size // 8)
    if length < min_len:
        return ()
    if member and min_len > LEAD + TAIL:
        return offset + LEAD, offset + length - TAIL
    return offset, offset + length


def tensor_boundaries(index: TensorIndex | None, chunk_size: int) -> list[int]:
    """Sorted cut points of every tensor (torch: every zip member) of at least chunk_size/8, as
    `record_cuts` places them."""
    if index is None:
        return []
    member = index.format in ("torch-zip", "torch-dcp")
    if member:
        spans: Iterable[tuple[int, int]] = ((r.offset, r.length) for r in index.records)
    else:
        spans = ((t.offset, t.length) for t in index.tensors)
    points: set[int] = set()
    for offset, length in spans:
        points.update(record_cuts(offset, length, chunk_size, member))
    return sorted(points)


def cut_points(read_at: ReadAt, size: int, index: TensorIndex | None, chunk_size: int,
               scanner: BoundaryScanner | None = None) -> list[int]:
    """The cut points of a `size`-byte file: its index's when it has one, else the scanner's.

    Blocking without an index (it reads the file through `read_at`): run it in a thread. `scanner`,
    one that has already consumed a prefix of these very bytes, saves reading that prefix again; it is
    copied, never changed."""
    if index is not None:
        return tensor_boundaries(index, chunk_size)
    scanner = scanner.copy() if scanner is not None else BoundaryScanner(chunk_size)
    scanner.advance(read_at, size, eof=True, budget=_INF)
    return scanner.boundaries


def chunk_end(pos: int, chunk_size: int, boundaries: Sequence[int]) -> int:
    """Where the chunk starting at `pos` ends, the end of the file aside: the next cut point, at most
    chunk_size on."""
    end = pos + chunk_size
    i = bisect.bisect_right(boundaries, pos)
    if i < len(boundaries) and boundaries[i] < end:
        end = boundaries[i]
    return end


def cut(size: int, chunk_size: int, boundaries: Sequence[int] = ()) -> list[tuple[int, int]]:
    """(offset, length) of every chunk of a `size`-byte file."""
    spans = []
    pos = 0
    while pos < size:
        end = min(chunk_end(pos, chunk_size, boundaries), size)
        spans.append((pos, end - pos))
        pos = end
    return spans


class _ShortRead(Exception):
    """The file is shorter than the scanner was told (truncated under it)."""


class BoundaryScanner:
    """Predicts a checkpoint's chunk cut points from its bytes, read in file order as they are written.

    The cut points are those `tensor_boundaries` derives from the finished file's index: `record_cuts`
    of every record of at least chunk_size/8 bytes, records being zip members (torch) or safetensors
    tensors. Zip members are followed through their local headers; a member written with a data
    descriptor (flag bit 3, as torch.save does) ends where a descriptor signature is followed by the
    member's own length, the only way to learn where it ends before the zip directory exists (and so
    where its last cut goes: until then `known_upto` stays TAIL bytes behind the scan). Searching every
    byte for that signature cost the daemon ~0.9 CPU-s per GiB saved, holding the GIL; but torch.save
    writes data.pkl first, and its persistent ids give every storage record's length, so the records
    after it are skipped to where their descriptor must be (`_zip_skip`), and only that is read.
    Zips back to back (a torch.distributed.checkpoint `.distcp` file) are followed one after another
    through their directories and end records. Anything else yields no cut points (fixed-size chunks).

    `advance` is blocking (it reads through `read_at`): run it in a thread. It decides only on bytes
    that exist, so advancing in steps over a growing file gives what one pass over the finished file
    gives, as long as the bytes it has read (below `read_upto`) do not change afterwards.
    """

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.min_len = max(1, chunk_size // 8)
        self.boundaries: list[int] = []   # sorted
        self.known_upto = 0               # every cut point below this offset is in `boundaries`
        self.need = 9                     # no progress until the file holds this many bytes
        self.read_upto = 0                # set before reading: bytes below it may have been used
        self._state = "detect"
        self._at = 0                      # next local header, or scan position in a member's data
        self._member = 0                  # data offset of the member being scanned
        self._big = False                 # that member is known to reach min_len
        self._pickle: bytes | None = None  # a torch zip's archive folder while its data.pkl is scanned
        self._sizes: dict[bytes, int] = {}  # member name -> length, from that data.pkl
        self._expect = 0                  # the length data.pkl gives the member being skipped
        # Byte ranges of finished tensor records (big zip members but data.pkl; a safetensors file's
        # data; all but the first bytes of any other file): neither the indexer nor the completeness
        # check (cpfs/completeness.py) reads them, so a writer may drop them from staging.
        self.interiors: list[tuple[int, int]] = []

    @property
    def done(self) -> bool:
        return self._state == "done"

    def copy(self) -> BoundaryScanner:
        clone = copy.copy(self)
        clone.boundaries = list(self.boundaries)
        clone.interiors = list(self.interiors)
        return clone

    def advance(self, read_at: ReadAt, limit: int, eof: bool = False, budget: int = 8 << 20) -> None:
        """Consume bytes below `limit` (with `eof`, the file ends there) until more are needed or
        about `budget` bytes were read."""
        start = self.read_upto
        try:
            while not self.done and (eof or self.need <= limit) and self.read_upto - start < budget:
                if not getattr(self, f"_{self._state}")(read_at, limit, eof):
                    break
        except _ShortRead:
            self.need = limit + 1  # a truncate raced us; the session restarts with a new scanner

    def _read(self, read_at: ReadAt, offset: int, length: int) -> bytes:
        self.read_upto = max(self.read_upto, offset + length)
        data = read_at(offset, length)
        if len(data) != length:
            raise _ShortRead
        return data

    def _finish(self) -> None:
        self._state = "done"
        self.need = self.known_upto = _INF

    def _have(self, end: int, limit: int, eof: bool) -> bool:
        """Whether bytes up to `end` exist; if the file ends before, scanning is over."""
        if end <= limit:
            return True
        if eof:
            self._finish()
        else:
            self.need = end
        return False

    @property
    def settled_upto(self) -> int:
        """Every tensor record that ends at or below this offset is in `interiors`."""
        if self.done:
            return _INF
        if self._state in ("zip_data", "zip_skip"):
            return self._member
        return self._at if self._state in ("zip_header", "zip_end") else 0

    def inside_record(self, start: int, end: int) -> bool:
        """Whether bytes [start, end) lie within one of `interiors`."""
        i = bisect.bisect_right(self.interiors, (start, _INF)) - 1
        return i >= 0 and self.interiors[i][1] >= end

    def _add(self, start: int, length: int) -> None:
        """A zip member's cuts (those of a big member being scanned may be there already)."""
        points = record_cuts(start, length, self.chunk_size, member=True)
        for point in points:
            if not self.boundaries or self.boundaries[-1] < point:
                self.boundaries.append(point)
        if points and self._pickle is None:
            self.interiors.append((start, start + length))

    def _detect(self, read_at: ReadAt, limit: int, eof: bool) -> bool:
        if not self._have(9, limit, eof):
            return False
        head = self._read(read_at, 0, 9)
        if head[:4] == _LOCAL:
            self._state, self._at = "zip_header", 0
        elif head[8:9] == b"{":
            self._state = "safetensors"
        else:
            self._finish()
            self.interiors = [(len(head), _INF)]  # not a checkpoint: nothing reads past its first bytes
        return True

    def _safetensors(self, read_at: ReadAt, limit: int, eof: bool) -> bool:
        (n,) = struct.unpack("<Q", self._read(read_at, 0, 8))
        if not 0 < n <= MAX_SAFETENSORS_HEADER:  # byte 8 is "{" by chance: not a checkpoint
            self._finish()
            self.interiors = [(9, _INF)]
            return True
        if not self._have(8 + n, limit, eof):
            return False
        points: set[int] = set()
        data_end = 8 + n
        try:
            header = json.loads(self._read(read_at, 8, n))
            for name, info in header.items():
                if name != "__metadata__":
                    begin, end = info["data_offsets"]
                    if isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end:
                        points.update(record_cuts(8 + n + begin, end - begin, self.chunk_size, member=False))
                        data_end = max(data_end, 8 + n + end)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            points = set()  # not safetensors after all: fixed-size chunks, and only the head is read
            data_end = _INF
        self.boundaries = sorted(points)
        if points or data_end == _INF:
            self.interiors = [(8 + n, data_end)]
        self._finish()
        return True

    def _zip_header(self, read_at: ReadAt, limit: int, eof: bool) -> bool:
        h = self._at
        self.known_upto = h
        if not self._have(h + 30, limit, eof):
            return False
        fixed = self._read(read_at, h, 30)
        if fixed[:4] != _LOCAL:  # the central directory, or not a zip we understand
            if fixed[:4] in _ZIP_END:
                self._state = "zip_end"
            else:
                self._finish()
            return True
        _, _, flags, _, _, _, _, comp, uncomp, nlen, elen = _LOCAL_HEADER.unpack(fixed)
        data = h + 30 + nlen + elen
        if not self._have(data, limit, eof):
            return False
        if flags & 8:  # sizes follow the data in a descriptor
            name = self._read(read_at, h + 30, nlen)
            self._member, self._at, self._big = data, data, False
            expect = self._sizes.get(name)
            if expect is not None:  # torch: data.pkl said how long it is
                self._state, self._expect = "zip_skip", expect
                return True
            self._state = "zip_data"
            if not self._sizes and name.endswith(b"/data.pkl"):
                self._pickle = name[:-len(b"data.pkl")]
            return True
        if _U32 in (comp, uncomp):
            comp = zip64_extra(self._read(read_at, h + 30 + nlen, elen), uncomp, comp)[1]
        self._add(data, comp)
        self._at = data + comp
        return True

    def _zip_end(self, read_at: ReadAt, limit: int, eof: bool) -> bool:
        """Past a zip's central directory and end records, each of which says how long it is. If
        another zip follows (torch.distributed.checkpoint's `.distcp` files: a torch.save per item,
        back to back), its members are cut as the first zip's were; anything else ends the scan."""
        h = self._at
        self.known_upto = h
        if not self._have(h + 4, limit, eof):
            return False
        sig = self._read(read_at, h, 4)
        if sig == _LOCAL:
            self._state, self._sizes, self._pickle = "zip_header", {}, None
            return True
        fixed = _ZIP_END.get(sig)
        if fixed is None:
            self._finish()
            return True
        if not self._have(h + fixed, limit, eof):
            return False
        head = self._read(read_at, h, fixed)
        if sig == _CENTRAL:
            self._at = h + fixed + sum(struct.unpack_from("<HHH", head, 28))
        elif sig == _END64:
            self._at = h + fixed + struct.unpack_from("<Q", head, 4)[0]
        elif sig == _END:
            self._at = h + fixed + struct.unpack_from("<H", head, 20)[0]
        else:
            self._at = h + fixed
        return True

    def _zip_data(self, read_at: ReadAt, limit: int, eof: bool) -> bool:
        start, pos = self._member, self._at
        end = min(limit, pos + (_SCAN_BLOCK if pos > start else PAGE))  # most members are small
        block = self._read(read_at, pos, end - pos) if end > pos else b""
        q = block.find(_DESCRIPTOR)
        while q >= 0:
            at = pos + q
            if at + 28 > limit and not eof:  # cannot tell yet: wait for the bytes after it
                self._scanned(at)
                self.need = at + 28
                return at > pos
            tail = block[q:q + 28] if q + 28 <= len(block) else self._read(read_at, at, min(28, limit - at))
            size = _descriptor_size(tail, at - start)
            if size:
                self._add(start, at - start)
                self._state, self._at = "zip_header", at + size
                if self._pickle is not None:
                    self._read_pickle(read_at, start, at - start)
                return True
            q = block.find(_DESCRIPTOR, q + 1)
        if eof and end >= limit:  # the member runs to the end of the file
            self._finish()
            return True
        self._scanned(max(pos, end - 3))  # a signature may straddle the block's end
        self.need = end + 1
        return self._at > pos

    def _read_pickle(self, read_at: ReadAt, start: int, length: int) -> None:
        """The torch zip's data.pkl is complete: the length of every storage record it names."""
        root, self._pickle = self._pickle, None
        assert root is not None
        sizes = storage_sizes(self._read(read_at, start, length)) if length <= MAX_PICKLE else {}
        self._sizes = {root + b"data/" + key.encode(): n for key, n in sizes.items()}

    def _zip_skip(self, read_at: ReadAt, limit: int, eof: bool) -> bool:
        """A storage record whose length data.pkl gave: only its data descriptor is read, where that
        length puts it, so that the scan of a torch.save costs no pass over its tensors' bytes. A
        descriptor elsewhere (a pickle that misstates a length) sends the member to `_zip_data`."""
        start, length = self._member, self._expect
        at = start + length
        if at + 28 <= limit or eof:
            tail = self._read(read_at, at, min(28, limit - at)) if at < limit else b""
            size = _descriptor_size(tail, length)
            if size:
                self._add(start, length)
                self._state, self._at = "zip_header", at + size
                return True
            # Not there: find this member's end by scanning, as for any other; the cuts below it that
            # the skip has reported stand only if the scan finds them too.
            del self.boundaries[bisect.bisect_left(self.boundaries, start):]
            self._state, self._at, self._big, self.known_upto = "zip_data", start, False, start
            return True
        # Its bytes up to `limit` exist; as data.pkl says, none of them ends the member. The scan would
        # read them to learn that; here they count as read (a change below read_upto voids the skip).
        self.read_upto = max(self.read_upto, limit)
        if limit - 3 > self._at:
            self._scanned(limit - 3)
        self.need = min(at + 28, limit + self.min_len)  # no read to amortise: step by a fraction of a chunk
        return False

    def _scanned(self, pos: int) -> None:
        """Bytes below `pos` of the current member hold no descriptor."""
        self._at = pos
        if not self._big and pos - self._member >= self.min_len:
            # Big, so it ends at or after pos: every cut but its last (at or after pos - TAIL) is known.
            self._big = True
            self.boundaries.extend(record_cuts(self._member, pos - self._member, self.chunk_size, member=True)[:-1])
        self.known_upto = pos - TAIL if self._big else self._member


def _descriptor_size(tail: bytes, length: int) -> int:
    """16 or 24 if `tail` starts a data descriptor for a member of `length` bytes, else 0.
    A false match needs the signature and the exact length at the same place: 64 bits by chance."""
    if len(tail) < 16 or tail[:4] != _DESCRIPTOR:
        return 0
    comp32, uncomp32 = struct.unpack_from("<II", tail, 8)
    if comp32 == length and (uncomp32 != 0 or tail[16:20] in _AFTER_MEMBER):
        return 16
    if len(tail) >= 24 and struct.unpack_from("<Q", tail, 8)[0] == length:
        return 24  # zip64 descriptor
    return 0
