"""Container helpers for streaming MP3 and Ogg Opus out of libsndfile (rtts/audio/encode.py): an in-memory file that
hands bytes out as they are written, LAME's empty Info frame detected so it can be dropped, and Ogg pages given one
fixed serial number so that the byte stream is deterministic."""

from __future__ import annotations


class MemoryFile:
    """Write-only file object for libsndfile's virtual I/O that hands out bytes as they are appended.

    libsndfile may seek back to patch a header (LAME's Info frame at close). Bytes already handed out cannot change,
    so writes into that region are dropped; the stream stays valid, just without the patched-in metadata.
    """

    def __init__(self) -> None:
        self._pending = bytearray()
        self._base = 0  # absolute offset of _pending[0] (= bytes handed out so far)
        self._pos = 0
        self.dropped = 0  # bytes of late header patches that could not be applied

    def write(self, data: bytes) -> int:
        n = len(data)
        start = self._pos - self._base
        if start < 0:  # patch of bytes already sent
            cut = min(-start, n)
            self.dropped += cut
            data, start = data[cut:], 0
        if data:
            end = start + len(data)
            if end > len(self._pending):
                self._pending.extend(bytes(end - len(self._pending)))
            self._pending[start:end] = data
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        size = self._base + len(self._pending)
        self._pos = offset if whence == 0 else (self._pos + offset if whence == 1 else size + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        return b""  # never read in write mode

    def take(self) -> bytes:
        """Bytes written since the previous take()."""
        out = bytes(self._pending)
        self._base += len(out)
        self._pending.clear()
        return out


_MP3_KBPS = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
_MP3_RATES = (44100, 48000, 32000)


def mp3_info_placeholder_length(data: bytes) -> int:
    """Length of LAME's empty Info/Xing frame at the start of `data` (0 if there is none).

    LAME reserves the first frame (MPEG-1 Layer III header + zeros) and fills in the Info tag at close by seeking
    back. A streamed file cannot be patched, and the zero frame would decode as 26 ms of silence, so it is dropped.
    """
    if len(data) < 4 or data[0] != 0xFF or (data[1] & 0xFE) != 0xFA:  # sync + MPEG-1 + Layer III
        return 0
    kbps_idx, rate_idx, padding = data[2] >> 4, (data[2] >> 2) & 3, (data[2] >> 1) & 1
    if not 0 < kbps_idx < len(_MP3_KBPS) or rate_idx >= len(_MP3_RATES):
        return 0
    length = 144000 * _MP3_KBPS[kbps_idx] // _MP3_RATES[rate_idx] + padding
    if len(data) < length or any(data[4:length]):
        return 0
    return length


def _ogg_crc_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else r << 1
        table.append(r & 0xFFFFFFFF)
    return tuple(table)


_OGG_CRC = _ogg_crc_table()


def ogg_crc(data: bytes | bytearray) -> int:
    """Ogg page checksum: CRC-32, polynomial 0x04C11DB7, not reflected, initial value 0."""
    crc, table = 0, _OGG_CRC
    for b in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ table[(crc >> 24) ^ b]
    return crc


class OggSerialRewriter:
    """Gives every Ogg page one fixed stream serial number (re-checksummed).

    libsndfile seeds the serial from the clock, which would make the output differ run to run; a fixed serial keeps
    the byte stream deterministic. Only whole pages pass; a partial page waits for the rest.
    """

    def __init__(self, serial: int) -> None:
        self._serial = (serial & 0xFFFFFFFF).to_bytes(4, "little")
        self._carry = bytearray()

    def feed(self, data: bytes) -> bytes:
        self._carry += data
        out = bytearray()
        buf = self._carry
        while len(buf) >= 27 and len(buf) >= 27 + buf[26]:
            if buf[:4] != b"OggS":  # not a page boundary: pass through untouched rather than corrupt it
                out += buf
                buf.clear()
                break
            header_len = 27 + buf[26]
            page_len = header_len + sum(buf[27:header_len])
            if len(buf) < page_len:
                break
            page = bytearray(buf[:page_len])
            page[14:18] = self._serial
            page[22:26] = b"\0\0\0\0"
            page[22:26] = ogg_crc(page).to_bytes(4, "little")
            out += page
            del buf[:page_len]
        return bytes(out)

    def close(self) -> bytes:
        rest, self._carry = bytes(self._carry), bytearray()
        return rest
