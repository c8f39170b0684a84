"""Checks a semantic candidate must pass before it is served: rule vetoes (same numbers, entities,
negation, direction) and the cross-encoder's probability (policies/cache/cross_encoder.py)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

_TOKEN = re.compile(r"[a-z0-9_]+(?:['’][a-z]+)?")
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?:%)?")
_CAPITALISED = re.compile(r"(?:^|(?<=[\s(\"'`]))([A-Z][\w'’-]*)")
_SENTENCE_END = re.compile(r"[.!?:;]\s*$")

_NUMBER_WORDS: dict[str, str] = {
    "zero": "0", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12",
    "thirteen": "13", "fourteen": "14", "fifteen": "15", "sixteen": "16", "seventeen": "17",
    "eighteen": "18", "nineteen": "19", "twenty": "20", "thirty": "30", "forty": "40",
    "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90",
    "hundred": "100", "thousand": "1000", "million": "1000000", "billion": "1000000000",
    "dozen": "12", "half": "0.5",
}
# "one" is left out: it is a pronoun far more often than a count ("which one is faster").

# A marker right after these (or right before these) is an infinitive, not a direction.
_INFINITIVE_BEFORE = frozenset(
    "how want wants wanted need needs needed able going used trying try tries have has had ought".split()
)
_INFINITIVE_AFTER = frozenset("be do have make get go use".split())

STOPWORDS: frozenset[str] = frozenset(
    """a an the and or but if of at by for with about against between through during in on
    off over under again further then once here there when where why how all any both each few
    more most other some such only own same so too very can will just should now is are was were
    be been being have has had having do does did doing i me my myself we our ours you your yours
    he him his she her it its they them their what which who whom this that these those am would
    could may might must shall as until while up down out into to from than please tell explain
    give show get let know want need like make way use using""".split()
)


def _forms(word: str) -> set[str]:
    stem = word[:-1] if word.endswith("e") else word
    return {word, word + "s", word + "es", word + "d", word + "ed", stem + "ing", stem + "er", stem + "est"}


_OPPOSITE_PAIRS: tuple[tuple[str, str], ...] = (
    ("man", "woman"), ("men", "women"), ("boy", "girl"), ("he", "she"), ("him", "her"),
    ("male", "female"), ("increase", "decrease"), ("before", "after"), ("above", "below"),
    ("buy", "sell"), ("min", "max"), ("minimum", "maximum"), ("encrypt", "decrypt"),
    ("encode", "decode"), ("compress", "decompress"), ("import", "export"), ("upload", "download"),
    ("enable", "disable"), ("add", "remove"), ("install", "uninstall"), ("open", "close"),
    ("win", "lose"), ("up", "down"), ("first", "last"), ("largest", "smallest"),
    ("highest", "lowest"), ("best", "worst"), ("more", "less"), ("true", "false"), ("push", "pull"),
    ("start", "stop"), ("north", "south"), ("east", "west"), ("hot", "cold"),
    ("ascending", "descending"), ("inner", "outer"), ("left", "right"), ("input", "output"),
    ("positive", "negative"), ("forward", "backward"),
)
_NEGATION_WORDS = ("not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "cannot", "without", "nowhere")
_WordPair = Annotated[tuple[str, str], Strict(False)]  # NOTE: YAML gives [a, b] lists; the words stay strict

_ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
# The verifier `verifier: bundled` names: the embedding-feature verifier (verifier_train.py writes it).
BUNDLED_VERIFIER = _ARTIFACTS / "verifier.npz"
# The cross-encoder (`verifier: cross_encoder`; cross_encoder_train.py writes it, with its chosen
# threshold in cross_encoder.json).
BUNDLED_CROSS_ENCODER = _ARTIFACTS / "cross_encoder.onnx"
# Chosen on the selection split with the bundled cross-encoder (artifacts/cross_encoder.json, policies/cache/MODEL_CARD.md).
DEFAULT_MIN_PROBABILITY = 0.94


class VerifySection(BaseModel):
    """The `cache.verify` policy section as written; its defaults are the shipped policy's.

    NOTE: policies/defaults/cache.yaml lists these same values (a test keeps the two equal).
    Strict: a misspelt key fails, and YAML's bare no/yes (booleans) are not taken for words.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    numbers: bool = Field(True, description='"5 km" never matches "50 km"')
    entities: bool = Field(True, description="capitalised names must appear on both sides")
    negation: bool = Field(True, description='"how do I enable" never matches "how do I not enable"')
    direction: bool = Field(True, description='"A to B" never matches "B to A"')
    opposites: bool = Field(True, description="a word of an opposite pair never matches the other")
    direction_window: int = Field(3, ge=1, description="words on each side of a direction marker")
    negation_words: list[str] = Field(default_factory=lambda: list(_NEGATION_WORDS))
    forward_markers: list[str] = Field(default_factory=lambda: ["to", "into", "towards", "than", "onto"])
    reverse_markers: list[str] = Field(default_factory=lambda: ["from"])
    opposite_pairs: list[_WordPair] = Field(default_factory=lambda: list(_OPPOSITE_PAIRS))
    verifier: str = Field(
        "cross_encoder",
        description="bundled, cross_encoder, off, or the path of an artifact (.npz: verifier_train.py, .onnx: cross_encoder_train.py)",
    )
    min_probability: float = Field(
        DEFAULT_MIN_PROBABILITY, ge=0.0, le=1.0, description="the cross-encoder's probability a hit needs"
    )

    @field_validator("verifier")
    @classmethod
    def _verifier_path(cls, value: str) -> str:
        if value not in ("bundled", "cross_encoder", "off") and not Path(value).is_file():
            raise ValueError(f"must be bundled, cross_encoder, off, or the path of a verifier artifact; {value!r} is not a file")
        return value

    @field_validator("negation_words", "forward_markers", "reverse_markers", mode="before")
    @classmethod
    def _quoted_words(cls, value: Any) -> Any:
        if isinstance(value, list) and not all(isinstance(w, str) for w in value):
            raise ValueError("must be a list of quoted words (YAML reads bare no/yes as booleans)")
        return value

    def config(self) -> VerifyConfig:
        """The checks as `verify` uses them: lowercased word sets, each opposite with its inflections."""
        config = VerifyConfig(
            numbers=self.numbers,
            entities=self.entities,
            negation=self.negation,
            direction=self.direction,
            opposites=self.opposites,
            negation_words=frozenset(w.lower() for w in self.negation_words),
            forward_markers=frozenset(w.lower() for w in self.forward_markers),
            reverse_markers=frozenset(w.lower() for w in self.reverse_markers),
            direction_window=self.direction_window,
            opposite_pairs=tuple(
                (frozenset(_forms(one.lower())), frozenset(_forms(other.lower()))) for one, other in self.opposite_pairs
            ),
            verifier=None if self.verifier == "off" else str(
                {"bundled": BUNDLED_VERIFIER, "cross_encoder": BUNDLED_CROSS_ENCODER}.get(self.verifier, self.verifier)
            ),
            min_probability=self.min_probability,
        )
        return dataclasses.replace(config, opposite_words=frozenset().union(*(x | y for x, y in config.opposite_pairs)))


@dataclass(slots=True, frozen=True)
class VerifyConfig:
    """Which checks run, and the word lists they use (built from `VerifySection`, which has the defaults)."""

    numbers: bool
    entities: bool
    negation: bool
    direction: bool
    opposites: bool
    negation_words: frozenset[str]
    forward_markers: frozenset[str]
    reverse_markers: frozenset[str]
    direction_window: int
    opposite_pairs: tuple[tuple[frozenset[str], frozenset[str]], ...]
    verifier: str | None = None  # the artifact's path; None: rule checks only
    min_probability: float = DEFAULT_MIN_PROBABILITY
    opposite_words: frozenset[str] = frozenset()  # every form of every opposite pair (a fast "none here")

    @classmethod
    def from_policy(cls, section: Mapping[str, Any]) -> VerifyConfig:
        """Parse a `cache.verify` section (missing keys: the shipped defaults); raises pydantic's ValidationError."""
        return VerifySection.model_validate(section or {}).config()


@dataclass(slots=True)
class Features:
    """What verification compares, extracted once per text."""

    tokens: list[str]
    vocabulary: set[str]
    numbers: Counter[str]
    entities: set[str]
    negations: int
    counts: Counter[str]
    relations: set[tuple[str, str]]


def _stem(token: str) -> str:
    token = token.replace("’", "'")
    if token.endswith("'s"):
        token = token[:-2]
    token = token.rstrip("'")
    if len(token) > 4 and token.endswith("ies"):
        return token[:-3] + "y"
    if len(token) > 3 and token.endswith("s") and not token.endswith("ss"):
        return token[:-1]
    return token


def _numbers(text: str, tokens: Iterable[str]) -> Counter[str]:
    found: Counter[str] = Counter()
    for raw in _NUMBER.findall(text):
        value = raw.replace(",", "") if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+", raw) else raw
        value = value.lstrip("+")
        if "." in value and not value.endswith("%"):
            value = value.rstrip("0").rstrip(".") or "0"
        found[value] += 1
    for token in tokens:
        if token in _NUMBER_WORDS:
            found[_NUMBER_WORDS[token]] += 1
    return found


def _entities(text: str) -> set[str]:
    words = text.split()
    capitalised = sum(1 for w in words if w[:1].isupper())
    if words and capitalised / len(words) > 0.6:
        return set()  # title case or shouting: capitals carry no signal
    out: set[str] = set()
    for match in _CAPITALISED.finditer(text):
        start = match.start(1)
        before = text[:start]
        if not before.strip() or _SENTENCE_END.search(before):
            continue
        word = match.group(1).lower().strip("'’-")
        for part in _TOKEN.findall(word):
            if part not in STOPWORDS and not part.isdigit() and part not in _NUMBER_WORDS:
                out.add(_stem(part))
    return out


def _negations(tokens: list[str], words: frozenset[str]) -> int:
    return sum(1 for t in tokens if t in words or t.endswith("n't") or t.endswith("n’t"))


def _relations(tokens: list[str], cfg: VerifyConfig) -> set[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    window = cfg.direction_window
    markers = cfg.forward_markers | cfg.reverse_markers
    for i, token in enumerate(tokens):
        forward = token in cfg.forward_markers
        if not forward and token not in cfg.reverse_markers:
            continue
        if token == "to" and (
            (i > 0 and tokens[i - 1] in _INFINITIVE_BEFORE)
            or (i + 1 < len(tokens) and tokens[i + 1] in _INFINITIVE_AFTER)
        ):
            continue
        left = _side(reversed(tokens[:i]), markers, window)
        right = _side(tokens[i + 1 :], markers, window)
        for x in left:
            for y in right:
                if x != y:
                    out.add((x, y) if forward else (y, x))
    return out


def _side(tokens: Iterable[str], markers: frozenset[str], window: int) -> list[str]:
    out: list[str] = []
    for token in tokens:
        if token in markers or len(out) == window:
            break
        if token not in STOPWORDS and not token[0].isdigit() and token not in _NUMBER_WORDS:
            out.append(_stem(token))
    return out


def features(text: str, cfg: VerifyConfig) -> Features:
    tokens = _TOKEN.findall(text.lower())
    return Features(
        tokens=tokens,
        vocabulary={_stem(t) for t in tokens},
        numbers=_numbers(text, tokens),
        entities=_entities(text) if cfg.entities else set(),
        negations=_negations(tokens, cfg.negation_words),
        counts=Counter(tokens),
        relations=_relations(tokens, cfg) if cfg.direction else set(),
    )


def _opposed(a: Features, b: Features, cfg: VerifyConfig) -> bool:
    # Opposed when one side of a pair gains mentions while the other loses them
    # ("upload" became "download"), counted so a word used twice is not hidden by one reuse.
    # Both texts need a word of some pair for that (one gains, the other had what was lost).
    if cfg.opposite_words and (cfg.opposite_words.isdisjoint(a.counts) or cfg.opposite_words.isdisjoint(b.counts)):
        return False
    for one, other in cfg.opposite_pairs:
        gained = sum(b.counts[w] for w in one) - sum(a.counts[w] for w in one)
        lost = sum(b.counts[w] for w in other) - sum(a.counts[w] for w in other)
        if gained * lost < 0:
            return True
    return False


def mismatch(a: Features, b: Features, cfg: VerifyConfig) -> str | None:
    """The first check the pair fails ("numbers", "negation", ...), or None when it passes."""
    if cfg.numbers and a.numbers != b.numbers:
        return "numbers"
    if cfg.negation and a.negations != b.negations:
        return "negation"
    if cfg.entities and (not a.entities <= b.vocabulary or not b.entities <= a.vocabulary):
        return "entities"
    if cfg.opposites and _opposed(a, b, cfg):
        return "opposites"
    if cfg.direction:
        for x, y in a.relations:
            if (y, x) in b.relations and (x, y) not in b.relations and (y, x) not in a.relations:
                return "direction"
    return None


def verify(a: str, b: str, cfg: VerifyConfig) -> str | None:
    """Compare two request texts; None means the cached answer to one fits the other."""
    return mismatch(features(a, cfg), features(b, cfg), cfg)
