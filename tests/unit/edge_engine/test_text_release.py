"""Text and token records released together: stop strings, held repeats, split characters."""

from __future__ import annotations

from edge_engine.text import TokenText


def _run(stream: TokenText[int], pieces: list[bytes], holds: list[int] | None = None) -> tuple[list[str], list[list[int]], bool]:
    texts, records, hit = [], [], False
    for i, piece in enumerate(pieces):
        text, infos, hit = stream.push(piece, i, holds[i] if holds else 0)
        texts.append(text)
        records.append(infos)
        if hit:
            break
    return texts, records, hit


def test_without_stops_each_token_goes_out_with_its_text() -> None:
    stream: TokenText[int] = TokenText([])
    texts, records, hit = _run(stream, [b"Hel", b"lo", b" world"])
    assert texts == ["Hel", "lo", " world"] and records == [[0], [1], [2]] and not hit
    assert stream.finish() == ("", [])


def test_a_held_stop_prefix_keeps_its_token_until_decided() -> None:
    stream: TokenText[int] = TokenText(["END"])
    texts, records, _ = _run(stream, [b"a", b"E", b"b"])
    assert texts == ["a", "", "Eb"] and records == [[0], [], [1, 2]]


def test_tokens_of_a_matched_stop_string_are_not_released() -> None:
    stream: TokenText[int] = TokenText(["END"])
    texts, records, hit = _run(stream, [b"ab", b" E", b"ND", b"x"])
    assert hit and "".join(texts) == "ab " and records == [[0], [], [1]]  # " E" gave " " before the stop


def test_a_character_split_across_tokens_goes_out_with_its_last_byte() -> None:
    stream: TokenText[int] = TokenText([])
    e_acute = "é".encode()
    texts, records, _ = _run(stream, [b"caf", e_acute[:1], e_acute[1:] + b"!"])
    assert texts == ["caf", "", "é!"] and records == [[0], [], [1, 2]]


def test_held_repeats_are_released_when_the_repeat_breaks() -> None:
    stream: TokenText[int] = TokenText([])
    texts, records, _ = _run(stream, [b"a", b"b", b"a", b"b", b"c"], holds=[0, 0, 1, 2, 0])
    assert texts == ["a", "b", "", "", "abc"] and records == [[0], [1], [], [], [2, 3, 4]]


def test_finish_drops_the_held_repeats_of_a_loop() -> None:
    stream: TokenText[int] = TokenText([])
    _, records, _ = _run(stream, [b"x", b"a", b"b", b"a", b"b", b"a"], holds=[0, 0, 0, 1, 2, 3])
    assert records == [[0], [1], [2], [], [], []]
    assert stream.finish(drop=3) == ("", [])
    stream = TokenText([])
    _run(stream, [b"x", b"a", b"b", b"a", b"b"], holds=[0, 0, 0, 0, 0])  # already streamed: stays
    assert stream.finish(drop=2) == ("", [])


def test_finish_flushes_a_held_stop_prefix_with_its_tokens() -> None:
    stream: TokenText[int] = TokenText(["END"])
    _run(stream, [b"a", b"EN"])
    assert stream.finish() == ("EN", [1])
