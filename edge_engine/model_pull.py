"""Downloads one hub GGUF into the model cache, resumably, and keeps it only if its sha256 is the pinned one.

The set-up step behind `tierlane edge pull`; the engine never calls it. The file is fetched from
`{endpoint}/{org}/{repo}/resolve/{revision}/{file}` (the hub's layout; HF_ENDPOINT names a mirror)
into `<file>.part` beside its place in the cache. An interrupted download leaves the part file,
and the next pull asks for the rest with an HTTP Range request (a server that ignores it and
answers the whole file is read from the start). The finished part is hashed as it is written;
only a file whose digest is the pinned one is moved into place, otherwise the part file is
deleted and `DigestMismatch` names both digests. A file already in place with the pinned digest
is left alone (its digest is remembered: a second pull reads no byte of it), and a part file that
is already the whole pinned file is moved into place without a request.

Whatever the server does, a pull is bounded (`PullLimits`): in bytes (the size the hub lists for
the pinned digest, else `max_bytes`; a body past it is cut and deleted), in time (`max_time_s`) and
in pace (at least `min_rate_kib` over each `rate_window_s`). A part file is only ever a regular file
opened without following links: a link or a device at its name is removed, never written through.
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import logging
import os
import re
import stat
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from edge_engine.model_source import (
    DEFAULT_ENDPOINT,
    PART_SUFFIX,
    HubFile,
    check_sha256,
    file_sha256,
    memo_file,
    remember_sha256,
)

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_HEX64 = re.compile(r'"?([0-9a-f]{64})"?')
USER_AGENT = "tierlane-edge-pull"
PullProgress = Callable[[int, int | None], None]  # (bytes of the file on disk, its size when known)
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class PullLimits:
    """Bounds on one pull, whatever the server sends; 0 turns the time or the pace bound off."""

    max_bytes: int = 32 * GIB  # well above any GGUF an edge lane runs on CPU (an 8B model at Q8 is ~8.5 GB)
    max_time_s: float = 6 * 3600.0
    min_rate_kib: float = 16.0  # KiB/s on average over each rate window ...
    rate_window_s: float = 120.0  # ... the first of which is the grace period of a slow start


class PullError(RuntimeError):
    """The file could not be downloaded (HTTP error, connection lost); a part file may be left to resume from."""

    def __init__(self, message: str, *, retry: bool = False, resumable: bool = False) -> None:
        super().__init__(message)
        self.retry = retry  # a lost connection: asking again may get further
        self.resumable = resumable  # not retried now, but a later pull continues the part file


class DigestMismatch(PullError):
    """The downloaded file is not the one edge.model_sha256 pins."""

    def __init__(self, what: str, expected: str, got: str) -> None:
        super().__init__(f"{what} does not match edge.model_sha256: expected {expected}, got {got}")
        self.expected = expected
        self.got = got


@dataclass(frozen=True, slots=True)
class PullResult:
    path: Path
    sha256: str
    already_there: bool  # the file was in place and verified: nothing was downloaded
    downloaded: int = 0  # bytes received in this pull
    resumed_from: int = 0  # bytes of an earlier part file the server agreed to continue from
    restarted: bool = False  # a part file was there, but the whole file was downloaded again


@dataclass(slots=True)
class _Transfer:
    """What one pull has done so far, the digest of the part file's bytes, and the pull's bounds."""

    part: Path
    digest: hashlib._Hash
    limits: PullLimits
    expected: str  # the pinned sha256
    downloaded: int = 0
    resumed_from: int = 0
    restarted: bool = False
    listed_size: int | None = None  # the size the hub lists for the pinned digest (X-Linked-Size)
    started: float = field(default_factory=time.monotonic)
    window_start: float = field(default_factory=time.monotonic)
    window_bytes: int = 0

    @property
    def size(self) -> int:
        try:
            return self.part.lstat().st_size
        except FileNotFoundError:
            return 0

    def start_over(self) -> None:
        self.part.unlink(missing_ok=True)
        self.digest = hashlib.sha256()
        self.restarted = True

    def bound(self) -> tuple[int, str]:
        """The most bytes the file may have, and why."""
        largest = self.limits.max_bytes
        why = f"{largest} bytes, the largest file `tierlane edge pull` takes (--max-gb)"
        if self.listed_size is not None and self.listed_size <= largest:
            return self.listed_size, f"the {self.listed_size} bytes the hub lists for the pinned sha256"
        return largest, why

    def pace(self, url: str, received: int) -> None:
        """Raises once the pull has taken too long, or the last rate window brought too few bytes."""
        now, limits = time.monotonic(), self.limits
        self.window_bytes += received
        if limits.max_time_s and now - self.started > limits.max_time_s:
            raise PullError(f"{url}: the pull took longer than {limits.max_time_s:g} s (--max-time-s)", resumable=True)
        spent = now - self.window_start
        if not limits.min_rate_kib or spent < limits.rate_window_s:
            return
        if self.window_bytes < limits.min_rate_kib * 1024 * spent:
            raise PullError(
                f"{url}: {self.window_bytes} bytes in the last {spent:.3g} s, below the minimum of "
                f"{limits.min_rate_kib:g} KiB/s (--min-rate-kib); a mirror may be faster (HF_ENDPOINT)",
                resumable=True,
            )
        self.window_start, self.window_bytes = now, 0


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows the hub's redirect and keeps what it says of the file: X-Linked-Size and X-Linked-Etag (its sha256)."""

    def __init__(self, transfer: _Transfer) -> None:
        super().__init__()
        self.transfer = transfer

    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: http.client.HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        size, etag = headers.get("X-Linked-Size", ""), _HEX64.fullmatch(headers.get("X-Linked-Etag", "").strip().lower())
        if size.isdigit() and etag is not None and etag.group(1) == self.transfer.expected:
            self.transfer.listed_size = int(size)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _clear_part(part: Path) -> None:
    """A link, device or FIFO at the part file's name is removed (the link itself, never what it points at)."""
    try:
        mode = part.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise PullError(f"{part} is a folder, not a part file: remove it and pull again")
    log.warning("%s is not a regular file (a link or a device): removed; the download starts from zero", part)
    part.unlink()


def _open_part(part: Path, flags: int) -> int:
    """A descriptor of the part file as a regular file at that very name."""
    # NOTE: O_NOFOLLOW refuses a link planted after _clear_part looked; O_NONBLOCK makes a FIFO fail
    # at once instead of waiting for a reader (it changes nothing for a regular file).
    try:
        fd = os.open(part, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        raise PullError(f"{part}: cannot open the part file ({exc.strerror}); remove it and pull again") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PullError(f"{part} is not a regular file: remove it and pull again")
    os.set_blocking(fd, True)
    return fd


@contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    """One pull at a time per cache folder (two replicas' set-up sharing a volume): the second fails fast."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PullError(f"another `tierlane edge pull` is writing into {folder}; wait for it") from None
        yield
    finally:
        os.close(fd)


def _request(url: str, offset: int, token: str | None) -> urllib.request.Request:
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    if token:
        # NOTE: not sent on to where the hub redirects (its CDN's signed addresses refuse a second credential).
        request.add_unredirected_header("Authorization", f"Bearer {token}")
    return request


def _http_failure(url: str, exc: urllib.error.HTTPError) -> PullError:
    hint = {
        401: "the repository is gated or private: accept its terms on the hub and set HF_TOKEN",
        403: "the repository is gated or private: accept its terms on the hub and set HF_TOKEN",
        404: "check the organisation, repository, revision and file name in edge.model",
    }.get(exc.code, "")
    return PullError(f"{url}: HTTP {exc.code} {exc.reason}" + (f" ({hint})" if hint else ""), retry=exc.code >= 500)


def _open(url: str, transfer: _Transfer, opener: urllib.request.OpenerDirector, token: str | None,
          timeout_s: float) -> tuple[Any, int]:
    """The response that continues the part file, and the offset it starts at (0: the whole file)."""
    offset = transfer.size
    try:
        response = opener.open(_request(url, offset, token), timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416 and offset:
            transfer.start_over()  # the part is as long as the file or longer: it is no prefix of it
            return _open(url, transfer, opener, token, timeout_s)
        raise _http_failure(url, exc) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise PullError(f"{url}: {getattr(exc, 'reason', exc)}", retry=True) from exc
    if response.status == 206 and offset:
        found = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
        if found is None or int(found.group(1)) != offset:
            # NOTE: appending these bytes would corrupt the part, and keeping it would meet the same
            # answer at every later pull: the part is discarded and the whole file asked for.
            response.close()
            log.warning("%s: asked for the bytes from %d, got %r: the part file is discarded and the whole file "
                        "asked for", url, offset, response.headers.get("Content-Range"))
            transfer.start_over()
            return _open(url, transfer, opener, token, timeout_s)
        transfer.resumed_from = offset
        return response, offset
    if response.status == 200:
        if offset:
            transfer.start_over()  # the server ignored Range and sends the whole file
        return response, 0
    response.close()
    raise PullError(f"{url}: unexpected HTTP {response.status}")


def _announced(response: Any, offset: int) -> int | None:
    """The file's size as the answer gives it (Content-Range's total, else offset + Content-Length)."""
    found = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "") or "")
    if offset and found is not None and found.group(3).isdigit():
        return int(found.group(3))
    length = response.headers.get("Content-Length")
    return offset + int(length) if length is not None and length.isdigit() else None


def _fetch_once(url: str, transfer: _Transfer, opener: urllib.request.OpenerDirector, token: str | None,
                timeout_s: float, progress: PullProgress | None) -> None:
    """One request: the part file continued to the end of the file, within the pull's bounds."""
    transfer.pace(url, 0)
    response, offset = _open(url, transfer, opener, token, timeout_s)
    limit, why = transfer.bound()
    with response:
        total = _announced(response, offset)
        if total is not None and total > limit:
            transfer.part.unlink(missing_ok=True)
            raise PullError(f"{url}: the server announces {total} bytes, more than {why}; nothing more was downloaded "
                            "and the part file was deleted")
        received = offset
        if progress is not None:
            progress(received, total)
        with os.fdopen(_open_part(transfer.part, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as out:
            try:
                # NOTE: read1, not read: read(n) waits for all n bytes, so a server dripping a byte at
                # a time would never let the time and pace bounds be checked.
                while block := response.read1(_CHUNK):
                    if received + len(block) > limit:
                        break
                    out.write(block)
                    transfer.digest.update(block)
                    received += len(block)
                    transfer.downloaded += len(block)
                    if progress is not None:
                        progress(received, total)
                    transfer.pace(url, len(block))
            except (OSError, http.client.HTTPException) as exc:  # IncompleteRead, a reset, a timeout
                raise PullError(f"{url}: connection lost after {received} bytes ({exc!r})", retry=True) from exc
        if block:
            transfer.part.unlink()
            raise PullError(f"{url}: the server sent more than {why}; the download was deleted")
    # NOTE: http.client ends a body cut short before its Content-Length quietly; count it here.
    if total is not None and received < total:
        raise PullError(f"{url}: connection lost after {received} of {total} bytes", retry=True)


def _hash_part(part: Path) -> hashlib._Hash:
    digest = hashlib.sha256()
    _clear_part(part)
    if part.exists():
        with os.fdopen(_open_part(part, os.O_RDONLY), "rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
    return digest


def pull(
    hub: HubFile,
    sha256: str,
    cache_dir: str | Path,
    *,
    endpoint: str = DEFAULT_ENDPOINT,
    token: str | None = None,
    retries: int = 3,
    timeout_s: float = 60.0,
    limits: PullLimits = PullLimits(),
    progress: PullProgress | None = None,
) -> PullResult:
    """The hub file in the model cache, verified against `sha256`; downloads only what is missing.

    `progress(done, total)` follows the part file as it grows (done may fall back to 0 when the
    server sends the whole file again). A lost connection is retried `retries` times, each from
    where the part file ends; after that PullError says to pull again, which resumes. `timeout_s`
    bounds each wait for the server, `limits` the whole pull (checked as bytes arrive, so it may
    be passed by one wait).
    """
    expected = check_sha256(sha256)
    path = hub.cache_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path.parent):
        if path.is_file():
            got = file_sha256(path, cache_dir)
            if got == expected:
                return PullResult(path, got, already_there=True)
            # NOTE: a file in place under another digest (a branch that moved, a pin that changed)
            # is never served; it is downloaded again.
            path.unlink()
            memo_file(path, cache_dir).unlink(missing_ok=True)
        part = path.with_name(path.name + PART_SUFFIX)
        url = hub.url(endpoint)
        transfer = _Transfer(part, _hash_part(part), limits, expected)
        if transfer.size and transfer.digest.hexdigest() == expected:
            # an earlier pull got every byte but stopped before moving the file into place
            transfer.resumed_from = transfer.size
        else:
            opener = urllib.request.build_opener(_Redirects(transfer))
            for attempt in range(retries + 1):
                try:
                    _fetch_once(url, transfer, opener, token, timeout_s, progress)
                    break
                except PullError as exc:
                    if exc.retry and attempt < retries:
                        continue
                    if (exc.retry or exc.resumable) and transfer.size:
                        raise PullError(f"{exc}; {transfer.size} bytes are kept: pull again to resume") from exc
                    raise
        got = transfer.digest.hexdigest()
        if got != expected:
            part.unlink(missing_ok=True)
            raise DigestMismatch(f"{url} (the download was deleted)", expected, got)
        os.replace(part, path)
        remember_sha256(path, memo_file(path, cache_dir), got)
        return PullResult(path, got, already_there=False, downloaded=transfer.downloaded,
                          resumed_from=transfer.resumed_from, restarted=transfer.restarted)
