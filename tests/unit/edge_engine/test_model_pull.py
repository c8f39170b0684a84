"""`edge_engine.model_pull`: a hub GGUF downloaded into the model cache from a local server with the hub's layout.

No network: the server is tests/support/hub_server.py on 127.0.0.1 (redirects like the hub's
`resolve`, honours Range, and can drop a connection or ignore Range on demand).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_engine.model_pull import DigestMismatch, PullError, PullLimits, pull
from edge_engine.model_source import MEMO_SUFFIX, PART_SUFFIX, parse_hub
from tests.support.hub_server import HubServer, RunningHub, gguf_bytes

DATA = gguf_bytes(3 * (1 << 20) + 12345)  # a few chunks of the download loop
DIGEST = hashlib.sha256(DATA).hexdigest()
HUB = parse_hub("hf://acme/tiny-GGUF@v1/tiny-q4_k_m.gguf")
KEY = "acme/tiny-GGUF/v1/tiny-q4_k_m.gguf"


@pytest.fixture
def hub() -> Iterator[RunningHub]:
    running = RunningHub(HubServer({KEY: DATA}))
    yield running
    running.close()


def cdn_requests(hub: RunningHub) -> list[tuple[str | None, int]]:
    return [(s.range, s.status) for s in hub.server.seen if s.path.startswith("/cdn/")]


def test_the_hub_url_and_cache_path_follow_the_hub_layout(tmp_path: Path) -> None:
    assert HUB.url("http://mirror.example/") == "http://mirror.example/acme/tiny-GGUF/resolve/v1/tiny-q4_k_m.gguf"
    assert HUB.cache_path(tmp_path) == tmp_path / "acme" / "tiny-GGUF" / "v1" / "tiny-q4_k_m.gguf"
    nested = parse_hub("hf://acme/tiny-GGUF/q4/tiny.gguf")
    assert nested.revision == "main" and nested.url().endswith("/acme/tiny-GGUF/resolve/main/q4/tiny.gguf")


def test_pull_verifies_keeps_and_then_finds_the_file_without_downloading(hub: RunningHub, tmp_path: Path) -> None:
    seen: list[tuple[int, int | None]] = []
    first = pull(HUB, DIGEST, tmp_path, endpoint=hub.url, progress=lambda done, total: seen.append((done, total)))
    assert first.path == tmp_path / "acme/tiny-GGUF/v1/tiny-q4_k_m.gguf"
    assert first.path.read_bytes() == DATA and first.sha256 == DIGEST
    assert not first.already_there and first.downloaded == len(DATA) and first.resumed_from == 0
    assert not first.path.with_name(first.path.name + PART_SUFFIX).exists()
    assert seen[-1] == (len(DATA), len(DATA)) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    # the digest is remembered beside the file, for this file version
    memo = json.loads(first.path.with_name(first.path.name + MEMO_SUFFIX).read_text())
    assert memo["sha256"] == DIGEST and memo["size"] == len(DATA)
    assert [s.status for s in hub.server.seen] == [302, 200]

    second = pull(HUB, DIGEST, tmp_path, endpoint=hub.url)
    assert second.already_there and second.downloaded == 0 and second.path == first.path
    assert len(hub.server.seen) == 2, "a second pull asks the server nothing"


def test_an_interrupted_download_resumes_with_a_range_request(hub: RunningHub, tmp_path: Path) -> None:
    cut = 1_500_000
    hub.server.drop_after, hub.server.drops_left = cut, 1
    with pytest.raises(PullError, match="pull again to resume"):
        pull(HUB, DIGEST, tmp_path, endpoint=hub.url, retries=0)
    final = HUB.cache_path(tmp_path)
    part = final.with_name(final.name + PART_SUFFIX)
    assert not final.exists() and part.read_bytes() == DATA[:cut]

    result = pull(HUB, DIGEST, tmp_path, endpoint=hub.url, retries=0)
    assert result.resumed_from == cut and result.downloaded == len(DATA) - cut and not result.restarted
    assert final.read_bytes() == DATA and not part.exists()
    assert cdn_requests(hub) == [(None, 200), (f"bytes={cut}-", 206)]


def test_a_lost_connection_is_resumed_within_one_pull(hub: RunningHub, tmp_path: Path) -> None:
    hub.server.drop_after, hub.server.drops_left = 1_000_000, 2
    result = pull(HUB, DIGEST, tmp_path, endpoint=hub.url, retries=3)
    assert result.path.read_bytes() == DATA
    assert cdn_requests(hub) == [(None, 200), ("bytes=1000000-", 206), ("bytes=2000000-", 206)]


def test_a_server_that_ignores_range_sends_the_whole_file_again(hub: RunningHub, tmp_path: Path) -> None:
    final = HUB.cache_path(tmp_path)
    final.parent.mkdir(parents=True)
    part = final.with_name(final.name + PART_SUFFIX)
    part.write_bytes(DATA[:700_000])
    hub.server.ignore_range = True
    result = pull(HUB, DIGEST, tmp_path, endpoint=hub.url)
    assert result.restarted and result.resumed_from == 0 and result.downloaded == len(DATA)
    assert final.read_bytes() == DATA, "the 200's body replaces the part file, not appended to it"
    assert cdn_requests(hub) == [("bytes=700000-", 200)]


def test_a_part_file_longer_than_the_file_is_started_again(hub: RunningHub, tmp_path: Path) -> None:
    final = HUB.cache_path(tmp_path)
    final.parent.mkdir(parents=True)
    final.with_name(final.name + PART_SUFFIX).write_bytes(DATA + b"junk")
    result = pull(HUB, DIGEST, tmp_path, endpoint=hub.url)
    assert final.read_bytes() == DATA and result.restarted
    assert cdn_requests(hub) == [(f"bytes={len(DATA) + 4}-", 416), (None, 200)]


def test_a_wrong_pinned_digest_is_refused_and_nothing_is_left_in_place(hub: RunningHub, tmp_path: Path) -> None:
    wrong = hashlib.sha256(b"another model").hexdigest()
    with pytest.raises(DigestMismatch) as caught:
        pull(HUB, wrong, tmp_path, endpoint=hub.url)
    assert f"expected {wrong}" in str(caught.value) and f"got {DIGEST}" in str(caught.value)
    assert (caught.value.expected, caught.value.got) == (wrong, DIGEST)
    folder = HUB.cache_path(tmp_path).parent
    assert sorted(folder.iterdir()) == [], "neither the file nor its part file is kept"


def test_a_cached_file_under_another_digest_is_downloaded_again(hub: RunningHub, tmp_path: Path) -> None:
    final = HUB.cache_path(tmp_path)
    final.parent.mkdir(parents=True)
    final.write_bytes(DATA[:-1] + b"!")
    result = pull(HUB, DIGEST, tmp_path, endpoint=hub.url)
    assert not result.already_there and final.read_bytes() == DATA


def test_a_missing_file_is_a_clear_error(hub: RunningHub, tmp_path: Path) -> None:
    with pytest.raises(PullError, match="HTTP 404.*check the organisation, repository, revision and file"):
        pull(parse_hub("hf://acme/tiny-GGUF/nope.gguf"), DIGEST, tmp_path, endpoint=hub.url)
    assert len(hub.server.seen) == 1, "a 404 is not retried"


def test_a_body_without_a_length_is_cut_at_the_size_bound_and_deleted(hub: RunningHub, tmp_path: Path) -> None:
    hub.server.chunked, hub.server.extra = True, 4 << 20  # no Content-Length, and far more than the file
    bound = len(DATA) + 1000
    seen: list[int] = []
    with pytest.raises(PullError, match=rf"more than {bound} bytes.*--max-gb.*deleted"):
        pull(HUB, DIGEST, tmp_path, endpoint=hub.url, limits=PullLimits(max_bytes=bound),
             progress=lambda done, total: seen.append(done))
    assert max(seen) <= bound, "no byte past the bound is written"
    assert sorted(HUB.cache_path(tmp_path).parent.iterdir()) == [], "the partial file is removed"


def test_a_length_announced_over_the_size_bound_is_refused_before_reading(hub: RunningHub, tmp_path: Path) -> None:
    seen: list[int] = []
    with pytest.raises(PullError, match=rf"announces {len(DATA)} bytes, more than {1 << 20} bytes"):
        pull(HUB, DIGEST, tmp_path, endpoint=hub.url, limits=PullLimits(max_bytes=1 << 20),
             progress=lambda done, total: seen.append(done))
    assert set(seen) <= {0}
    assert sorted(HUB.cache_path(tmp_path).parent.iterdir()) == []


def test_the_size_the_hub_lists_for_the_pinned_digest_bounds_the_body(hub: RunningHub, tmp_path: Path) -> None:
    hub.server.linked, hub.server.chunked, hub.server.extra = True, True, 1 << 20
    seen: list[int] = []
    with pytest.raises(PullError, match=rf"more than the {len(DATA)} bytes the hub lists"):
        pull(HUB, DIGEST, tmp_path, endpoint=hub.url, progress=lambda done, total: seen.append(done))
    assert max(seen) <= len(DATA)
    assert sorted(HUB.cache_path(tmp_path).parent.iterdir()) == []
    hub.server.extra = 0
    assert pull(HUB, DIGEST, tmp_path, endpoint=hub.url).path.read_bytes() == DATA


def test_a_dripping_server_is_given_up_on_at_the_time_bound(hub: RunningHub, tmp_path: Path) -> None:
    hub.server.drip_s, hub.server.drip_bytes = 0.02, 300  # each read is quick; the whole would take 6 s and more
    with pytest.raises(PullError, match=r"took longer than 0.3 s \(--max-time-s\).*bytes are kept: pull again to resume"):
        pull(HUB, DIGEST, tmp_path, endpoint=hub.url, timeout_s=30,
             limits=PullLimits(max_time_s=0.3, min_rate_kib=0))
    part = HUB.cache_path(tmp_path).with_name(HUB.cache_path(tmp_path).name + PART_SUFFIX)
    assert 0 < part.stat().st_size < 300 and DATA.startswith(part.read_bytes())


def test_a_server_below_the_minimum_rate_is_given_up_on(hub: RunningHub, tmp_path: Path) -> None:
    hub.server.drip_s, hub.server.drip_bytes = 0.02, 300
    with pytest.raises(PullError, match=r"below the minimum of 64 KiB/s \(--min-rate-kib\).*HF_ENDPOINT"):
        pull(HUB, DIGEST, tmp_path, endpoint=hub.url, timeout_s=30,
             limits=PullLimits(max_time_s=0, min_rate_kib=64, rate_window_s=0.3))


def test_a_complete_part_file_is_verified_and_moved_into_place_without_a_request(hub: RunningHub, tmp_path: Path) -> None:
    final = HUB.cache_path(tmp_path)
    final.parent.mkdir(parents=True)
    final.with_name(final.name + PART_SUFFIX).write_bytes(DATA)
    result = pull(HUB, DIGEST, tmp_path, endpoint=hub.url)
    assert final.read_bytes() == DATA and result.downloaded == 0 and not result.already_there
    assert hub.server.seen == [], "nothing is downloaded again"


def test_a_range_answer_at_another_offset_discards_the_part_and_starts_from_zero(hub: RunningHub, tmp_path: Path) -> None:
    final = HUB.cache_path(tmp_path)
    final.parent.mkdir(parents=True)
    final.with_name(final.name + PART_SUFFIX).write_bytes(DATA[:700_000])
    hub.server.range_from = 0  # a 206 from byte 0 to a request for the bytes from 700000
    result = pull(HUB, DIGEST, tmp_path, endpoint=hub.url)
    assert final.read_bytes() == DATA and result.restarted and result.resumed_from == 0
    assert cdn_requests(hub) == [("bytes=700000-", 206), (None, 200)]


def test_a_link_at_the_part_files_name_is_never_written_through(hub: RunningHub, tmp_path: Path) -> None:
    final = HUB.cache_path(tmp_path)
    final.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    final.with_name(final.name + PART_SUFFIX).symlink_to(victim)
    result = pull(HUB, DIGEST, tmp_path, endpoint=hub.url)
    assert victim.read_bytes() == b"precious"
    assert not final.is_symlink() and final.read_bytes() == DATA and result.resumed_from == 0
    assert cdn_requests(hub) == [(None, 200)]


def test_a_folder_at_the_part_files_name_is_a_clear_error(hub: RunningHub, tmp_path: Path) -> None:
    final = HUB.cache_path(tmp_path)
    final.with_name(final.name + PART_SUFFIX).mkdir(parents=True)
    with pytest.raises(PullError, match="is a folder, not a part file: remove it"):
        pull(HUB, DIGEST, tmp_path, endpoint=hub.url)
