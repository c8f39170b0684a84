"""Downloads one hub GGUF into the model cache, resumably, and keeps it only if its sha256 is the pinned one.

The set-up step behind `tierlane edge pull`; the engine never calls it. The file is fetched from
`{endpoint}/{org}/{repo}/resolve/{revision}/{file}` (the hub's layout; HF_ENDPOINT names a mirror)
into `<file>.part` beside its place in the cache. An interrupted download leaves the part file,
and the next pull asks for the rest with an HTTP Range request (a server that ignores it and
answers the whole file is read from the start). The finished part is hashed as it is written;
only a file whose digest is the pinned one is moved into place, otherwise the part file is
deleted and `DigestMismatch` names both digests. A file already in place with the pinned digest
is left alone (its digest is remembered: a second pull reads no byte of it).
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_engine.model_source import (
    DEFAULT_ENDPOINT,
    PART_SUFFIX,
    HubFile,
    check_sha256,
    file_sha256,
    memo_file,
    remember_sha256,
)

_CHUNK = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
USER_AGENT = "tierlane-edge-pull"
PullProgress = Callable[[int, int | None], None]  # (bytes of the file on disk, its size when known)


class PullError(RuntimeError):
    """The file could not be downloaded (HTTP error, connection lost); a part file may be left to resume from."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry  # a lost connection: asking again may get further


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
    """What one pull has done so far, and the digest of the part file's bytes."""

    part: Path
    digest: hashlib._Hash
    downloaded: int = 0
    resumed_from: int = 0
    restarted: bool = False

    @property
    def size(self) -> int:
        return self.part.stat().st_size if self.part.exists() else 0

    def start_over(self) -> None:
        self.part.unlink(missing_ok=True)
        self.digest = hashlib.sha256()
        self.restarted = True


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


def _open(url: str, transfer: _Transfer, token: str | None, timeout_s: float) -> tuple[Any, int]:
    """The response that continues the part file, and the offset it starts at (0: the whole file)."""
    offset = transfer.size
    try:
        response = urllib.request.urlopen(_request(url, offset, token), timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416 and offset:
            transfer.start_over()  # the part is as long as the file or longer: it is no prefix of it
            return _open(url, transfer, token, timeout_s)
        raise _http_failure(url, exc) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise PullError(f"{url}: {getattr(exc, 'reason', exc)}", retry=True) from exc
    if response.status == 206 and offset:
        found = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
        if found is None or int(found.group(1)) != offset:
            response.close()
            raise PullError(f"{url}: asked for the bytes from {offset}, got {response.headers.get('Content-Range')!r}")
        transfer.resumed_from = offset
        return response, offset
    if response.status == 200:
        if offset:
            transfer.start_over()  # the server ignored Range and sends the whole file
        return response, 0
    response.close()
    raise PullError(f"{url}: unexpected HTTP {response.status}")


def _fetch_once(url: str, transfer: _Transfer, token: str | None, timeout_s: float, progress: PullProgress | None) -> None:
    """One request: the part file continued to the end of the file."""
    response, offset = _open(url, transfer, token, timeout_s)
    with response:
        length = response.headers.get("Content-Length")
        total = offset + int(length) if length is not None and length.isdigit() else None
        received = offset
        if progress is not None:
            progress(received, total)
        with transfer.part.open("ab") as out:
            try:
                while block := response.read(_CHUNK):
                    out.write(block)
                    transfer.digest.update(block)
                    received += len(block)
                    transfer.downloaded += len(block)
                    if progress is not None:
                        progress(received, total)
            except (OSError, http.client.HTTPException) as exc:  # IncompleteRead, a reset, a timeout
                raise PullError(f"{url}: connection lost after {received} bytes ({exc!r})", retry=True) from exc
    # NOTE: http.client ends a body cut short before its Content-Length quietly; count it here.
    if total is not None and received < total:
        raise PullError(f"{url}: connection lost after {received} of {total} bytes", retry=True)


def _hash_part(part: Path) -> hashlib._Hash:
    digest = hashlib.sha256()
    if part.exists():
        with part.open("rb") as fh:
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
    progress: PullProgress | None = None,
) -> PullResult:
    """The hub file in the model cache, verified against `sha256`; downloads only what is missing.

    `progress(done, total)` follows the part file as it grows (done may fall back to 0 when the
    server sends the whole file again). A lost connection is retried `retries` times, each from
    where the part file ends; after that PullError says to pull again, which resumes.
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
        transfer = _Transfer(part, _hash_part(part))
        for attempt in range(retries + 1):
            try:
                _fetch_once(url, transfer, token, timeout_s, progress)
                break
            except PullError as exc:
                if not exc.retry or attempt == retries:
                    if exc.retry and part.exists():
                        raise PullError(f"{exc}; {part.stat().st_size} bytes are kept: pull again to resume") from exc
                    raise
        got = transfer.digest.hexdigest()
        if got != expected:
            part.unlink(missing_ok=True)
            raise DigestMismatch(f"{url} (the download was deleted)", expected, got)
        os.replace(part, path)
        remember_sha256(path, memo_file(path, cache_dir), got)
        return PullResult(path, got, already_there=False, downloaded=transfer.downloaded,
                          resumed_from=transfer.resumed_from, restarted=transfer.restarted)
