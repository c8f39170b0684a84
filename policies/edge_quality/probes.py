"""The edge probe set: checkable tasks of graded difficulty, generated reproducibly from a seed.

Seven families (`FAMILIES`), each with several phrasings written as a user would ask. Every
probe carries what its checker needs (checkers.py). Two splits that share no item:

* ``calibration``: fitting the prior and confidence models and choosing thresholds;
* ``held_out``: reported only, never fitted on nor used to pick a threshold. Its items (facts,
  words, ARC questions, number pairs) are disjoint from calibration's, it is drawn with another
  seed, and one phrasing per family appears only in it.

The shipped ``probes/probes.jsonl`` is this module's output for ``DEFAULT_SEED``;
``tests/unit/edge_quality/test_probes.py`` regenerates it and compares.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from policies.edge_quality import facts

DEFAULT_SEED = 20261201
SPLITS = ("calibration", "held_out")
FAMILIES = ("arithmetic", "facts", "word", "extraction", "comparison", "rewrite", "science_mc")
PER_FAMILY = {"calibration": 100, "held_out": 50}
PROBES_FILE = "probes.jsonl"
ARC_FILE = "arc_train_subset.jsonl"


@dataclass(frozen=True, slots=True)
class Probe:
    """One checkable task: a single user turn and what a correct answer must contain."""

    id: str
    family: str
    task: str  # the kind of task inside the family (e.g. "multiply", "capital", "reverse")
    level: int  # difficulty, 1 (easiest) upward
    split: str
    prompt: str  # the user message
    check: str  # checker kind, see checkers.CHECKERS
    answer: str
    aliases: tuple[str, ...] = ()  # other accepted answers
    distractors: tuple[str, ...] = ()  # content that must not appear (e.g. the other number in the text)
    choices: tuple[str, ...] = ()  # multiple choice: option texts, labelled A, B, C, ...

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        for key in ("aliases", "distractors", "choices"):
            row[key] = list(row[key])
        return row

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Probe:
        return cls(**{**row, **{k: tuple(row.get(k) or ()) for k in ("aliases", "distractors", "choices")}})


def package_dir() -> Path:
    return Path(str(resources.files("policies.edge_quality") / "probes"))


def default_probes_path() -> Path:
    return package_dir() / PROBES_FILE


def load_probes(path: str | Path | None = None, split: str | None = None) -> list[Probe]:
    """The probe set (None: the shipped one), optionally one split."""
    p = default_probes_path() if path is None else Path(path)
    with p.open(encoding="utf-8") as fh:
        probes = [Probe.from_json(json.loads(line)) for line in fh if line.strip()]
    return [q for q in probes if split is None or q.split == split]


def probe_set_hash(probes: Iterable[Probe]) -> str:
    digest = hashlib.sha256()
    for probe in probes:
        digest.update(json.dumps(probe.to_json(), sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return digest.hexdigest()


def write_probes(probes: Sequence[Probe], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as fh:
        for probe in probes:
            fh.write(json.dumps(probe.to_json(), ensure_ascii=False) + "\n")


def _in_held_out(key: str) -> bool:
    """A fixed third of the items of each table belongs to the held-out split, by a hash of the item."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 3 == 0


def _pool(items: Sequence[Any], split: str, key: Callable[[Any], str]) -> list[Any]:
    return [item for item in items if _in_held_out(key(item)) == (split == "held_out")]


def _templates(all_templates: Sequence[str], split: str) -> Sequence[str]:
    """The last phrasing of each task is only ever seen in the held-out split."""
    return all_templates if split == "held_out" else all_templates[:-1]


# ---- arithmetic -------------------------------------------------------------------------------

_ARITH_LEVELS: tuple[tuple[str, int, int], ...] = (
    # (operator, digits of a, digits of b), easiest first
    ("+", 1, 1), ("-", 1, 1), ("*", 1, 1), ("+", 2, 2), ("-", 2, 2), ("*", 2, 1),
    ("+", 3, 3), ("*", 2, 2), ("+", 4, 4), ("*", 3, 2), ("*", 4, 4),
)
_ARITH_TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": ("What is {a} + {b}?", "Calculate {a} plus {b}.", "what's {a}+{b}", "Can you add {a} and {b} for me?",
          "Quick math: {a} + {b} = ?", "Add {a} to {b}. What do you get?"),
    "-": ("What is {a} - {b}?", "Calculate {a} minus {b}.", "what's {a}-{b}", "Subtract {b} from {a}.",
          "Quick math: {a} - {b} = ?", "If I have {a} and take away {b}, how many are left?"),
    "*": ("What is {a} * {b}?", "Calculate {a} times {b}.", "what's {a}x{b}", "Multiply {a} by {b}.",
          "Quick math: {a} × {b} = ?", "What do you get when you multiply {a} and {b}?"),
}


def _digits(rng: random.Random, n: int) -> int:
    return rng.randint(1 if n == 1 else 10 ** (n - 1), 10**n - 1)


def _arithmetic(rng: random.Random, split: str, n: int, seen: set[Any]) -> Iterator[Probe]:
    made = 0
    while made < n:
        level = made % len(_ARITH_LEVELS)
        op, da, db = _ARITH_LEVELS[level]
        a, b = _digits(rng, da), _digits(rng, db)
        if op == "-" and b > a:
            a, b = b, a
        if (op, a, b) in seen:
            continue
        seen.add((op, a, b))
        value = a + b if op == "+" else a - b if op == "-" else a * b
        template = rng.choice(_templates(_ARITH_TEMPLATES[op], split))
        task = {"+": "add", "-": "subtract", "*": "multiply"}[op]
        yield Probe("", "arithmetic", task, level + 1, split, template.format(a=a, b=b), "number_last", str(value))
        made += 1


# ---- lookup facts -----------------------------------------------------------------------------

_FACT_TEMPLATES: dict[str, tuple[str, ...]] = {
    "capital": ("What is the capital of {x}?", "What's the capital city of {x}?", "Which city is the capital of {x}?",
                "capital of {x}?", "Tell me the capital of {x}.", "Name the capital of {x}."),
    "symbol": ("What is the chemical symbol for {x}?", "What's the symbol of the element {x}?",
               "Which chemical symbol does {x} have?", "chemical symbol of {x}?", "Give me the element symbol for {x}."),
    "author": ("Who wrote {x}?", "Who is the author of {x}?", "who wrote the book {x}", "Name the author of {x}.",
               "{x} was written by whom?"),
    "currency": ("What is the currency of {x}?", "What money do they use in {x}?", "Which currency is used in {x}?",
                 "currency of {x}?", "What's the name of {x}'s currency?"),
    "opposite": ("What is the opposite of '{x}'?", "What's the opposite of {x}?", "Give me an antonym of the word {x}.",
                 "opposite of {x}?", "Which word means the opposite of '{x}'?"),
    "general": ("{x}", "{x}", "Quick question: {x}", "{x} Answer briefly.", "I was wondering: {x}"),
}
_FACT_TABLES: dict[str, tuple[tuple[str, ...], ...]] = {
    "capital": facts.CAPITALS, "symbol": facts.SYMBOLS, "author": facts.AUTHORS,
    "currency": facts.CURRENCIES, "opposite": facts.OPPOSITES, "general": facts.GENERAL,
}
_FACT_LEVEL = {"capital": 1, "general": 1, "opposite": 2, "symbol": 2, "author": 3, "currency": 3}


def _facts(rng: random.Random, split: str, n: int, seen: set[Any]) -> Iterator[Probe]:
    rows = [(task, row) for task, table in _FACT_TABLES.items() for row in _pool(table, split, lambda r: "|".join(r))]
    rng.shuffle(rows)
    for task, row in rows[:n]:
        template = rng.choice(_templates(_FACT_TEMPLATES[task], split))
        check = "symbol" if task == "symbol" else "mention"
        yield Probe("", "facts", task, _FACT_LEVEL[task], split, template.format(x=row[0]), check, row[1], tuple(row[2:]))


# ---- word tasks -------------------------------------------------------------------------------

WORDS: tuple[str, ...] = tuple(
    """cat dog sun car hat pen cup map box egg bus fox owl ice jam key leg net pig rug toy van web zoo
    bird fish tree book lamp moon star rain snow wind door milk cake ship frog king ring song gold coin
    apple bread chair table house river plant stone cloud water light music paper horse mouse train
    green smile dream beach grape lemon tiger zebra piano robot candle garden window orange yellow purple
    bottle button castle dragon flower forest island jacket ladder mirror needle pencil rabbit silver
    spider summer winter basket turtle monkey planet rocket violin wizard kitchen blanket chicken diamond
    dolphin feather giraffe hammock lantern library mountain notebook elephant umbrella sandwich treasure
    tomorrow butterfly chocolate adventure telephone crocodile pineapple strawberry watermelon blueberry
    computer keyboard hospital festival triangle princess sunflower airplane backpack calendar""".split()
)
_WORD_TEMPLATES: dict[str, tuple[str, ...]] = {
    "uppercase": ("Write the word '{w}' in uppercase.", "Convert {w} to all capital letters.", "uppercase this: {w}",
                  "Please write {w} in capital letters.", "Can you put the word \"{w}\" in upper case?"),
    "reverse": ("Reverse the word '{w}'.", "Spell {w} backwards.", "What is '{w}' written backwards?",
                "reverse the letters of {w}", "Write the letters of the word \"{w}\" in reverse order."),
    "count": ("How many letters are in the word '{w}'?", "How many letters does {w} have?", "count the letters in {w}",
              "What is the number of letters in the word \"{w}\"?", "How long is the word '{w}' in letters?"),
    "first": ("What is the first letter of the word '{w}'?", "Which letter does {w} start with?",
              "first letter of {w}?", "What letter does the word \"{w}\" begin with?", "Tell me the first letter of '{w}'."),
    "last": ("What is the last letter of the word '{w}'?", "Which letter does {w} end with?", "last letter of {w}?",
             "What letter does the word \"{w}\" end with?", "Tell me the final letter of '{w}'."),
}
_WORD_CHECK = {"uppercase": "exact_case", "reverse": "mention", "count": "number_last", "first": "letter", "last": "letter"}


def _word_answer(task: str, word: str) -> str:
    return {"uppercase": word.upper(), "reverse": word[::-1], "count": str(len(word)), "first": word[0], "last": word[-1]}[task]


def _words(rng: random.Random, split: str, n: int, seen: set[Any]) -> Iterator[Probe]:
    pool = _pool(WORDS, split, lambda w: "word|" + w)
    tasks = list(_WORD_TEMPLATES)
    made = 0
    while made < n:
        task, word = tasks[made % len(tasks)], rng.choice(pool)
        if (task, word) in seen:
            continue
        seen.add((task, word))
        level = 1 + (len(word) > 4) + (len(word) > 7) + (task in ("reverse", "count"))
        template = rng.choice(_templates(_WORD_TEMPLATES[task], split))
        yield Probe("", "word", task, level, split, template.format(w=word), _WORD_CHECK[task], _word_answer(task, word))
        made += 1


# ---- extraction from a given text -------------------------------------------------------------

_NAMES = ("Maria Lopez", "John Carter", "Aisha Khan", "Tom Becker", "Yuki Tanaka", "Lena Novak", "Omar Haddad",
          "Grace Kim", "Peter Walsh", "Sofia Rossi", "David Chen", "Emma Brown", "Lucas Silva", "Nina Petrova",
          "Samuel Okafor", "Hannah Weber", "Carlos Ruiz", "Julia Meyer", "Ravi Patel", "Chloe Martin")
_ITEMS = ("apples", "books", "tickets", "chairs", "pencils", "oranges", "cups", "lamps", "shirts", "plants")
_PLACES = ("Lisbon", "Denver", "Oslo", "Cairo", "Toronto", "Madrid", "Osaka", "Dublin", "Perth", "Nairobi")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_SENTENCES = (
    "{p1} bought {n1} {item} for {n2} dollars in {place} on {month} {day}.",
    "On {month} {day}, {p1} sold {n1} {item} to {p2} for {n2} euros.",
    "{p1} met {p2} in {place} on {month} {day} and gave them {n1} {item}.",
    "According to the report, {p1} shipped {n1} {item} from {place} on {month} {day}, {n2} more than {p2}.",
    "{p2} said that {p1} had ordered {n1} {item} in {place}, and they arrived on {month} {day}.",
)
_EXTRACT_QUESTIONS: dict[str, tuple[str, ...]] = {
    "who": ("Text: \"{s}\"\nWho {verb}?", "{s} Who {verb}?", "Read this: {s}\nQuestion: who {verb}?",
            "In the sentence '{s}', who {verb}?", "Here is a sentence: {s} Name the person who {verb}."),
    "count": ("Text: \"{s}\"\nHow many {item} were involved?", "{s} How many {item}?",
              "Read this: {s}\nQuestion: how many {item} are mentioned?", "In the sentence '{s}', how many {item} were there?",
              "Here is a sentence: {s} What number of {item} does it mention?"),
    "date": ("Text: \"{s}\"\nOn what date did it happen?", "{s} When did this happen?",
             "Read this: {s}\nQuestion: what date is mentioned?", "In the sentence '{s}', on which date did it happen?",
             "Here is a sentence: {s} Which day and month does it mention?"),
    "place": ("Text: \"{s}\"\nWhere did it happen?", "{s} Which city is mentioned?",
              "Read this: {s}\nQuestion: in which city did it happen?", "In the sentence '{s}', what place is named?",
              "Here is a sentence: {s} Name the city it mentions."),
}
_VERBS = {0: "bought them", 1: "sold them", 2: "gave them away", 3: "shipped them", 4: "ordered them"}


def _extraction(rng: random.Random, split: str, n: int, seen: set[Any]) -> Iterator[Probe]:
    tasks = list(_EXTRACT_QUESTIONS)
    made = 0
    while made < n:
        task = tasks[made % len(tasks)]
        k = rng.randrange(len(_SENTENCES))
        if task == "place" and "{place}" not in _SENTENCES[k]:
            continue
        p1, p2 = rng.sample(_NAMES, 2)
        n1, n2 = rng.sample(range(2, 99), 2)
        month, day, place, item = rng.choice(_MONTHS), rng.randint(1, 28), rng.choice(_PLACES), rng.choice(_ITEMS)
        key = (task, k, p1, n1, month, day)
        if key in seen:
            continue
        seen.add(key)
        sentence = _SENTENCES[k].format(p1=p1, p2=p2, n1=n1, n2=n2, item=item, place=place, month=month, day=day)
        template = rng.choice(_templates(_EXTRACT_QUESTIONS[task], split))
        prompt = template.format(s=sentence, verb=_VERBS[k], item=item)
        distract: tuple[str, ...] = ()
        if task == "who":
            answer, check = p1, "mention"
            distract = (p2,) if "{p2}" in _SENTENCES[k] else ()
        elif task == "count":
            answer, check = str(n1), "number_in_text"
            distract = (str(n2),) if "{n2}" in _SENTENCES[k] else ()
        elif task == "date":
            answer, check = f"{month} {day}", "date"
        else:
            answer, check = place, "mention"
        level = 1 + (len(distract) > 0) + (k >= 3)
        yield Probe("", "extraction", task, level, split, prompt, check, answer, distractors=distract)
        made += 1


# ---- yes/no comparisons -----------------------------------------------------------------------

_COMPARE_TEMPLATES: dict[str, tuple[str, ...]] = {
    "greater": ("Is {a} greater than {b}?", "Is {a} > {b}? Answer yes or no.", "is {a} bigger than {b}",
                "Yes or no: is {a} larger than {b}?", "Tell me yes or no. Is {a} more than {b}?"),
    "less": ("Is {a} less than {b}?", "Is {a} < {b}? Answer yes or no.", "is {a} smaller than {b}",
             "Yes or no: is {a} lower than {b}?", "Tell me yes or no. Is {a} fewer than {b}?"),
    "even": ("Is {a} an even number?", "Is {a} even? Answer yes or no.", "is {a} even",
             "Yes or no: is {a} divisible by 2?", "Tell me yes or no. Is the number {a} even?"),
    "before": ("Does '{w1}' come before '{w2}' in alphabetical order?", "Alphabetically, is {w1} before {w2}?",
               "does {w1} come before {w2} alphabetically", "Yes or no: in a dictionary, is '{w1}' listed before '{w2}'?",
               "Tell me yes or no. Would {w1} appear before {w2} in an alphabetical list?"),
    "longer": ("Is the word '{w1}' longer than the word '{w2}'?", "Does {w1} have more letters than {w2}?",
               "is {w1} a longer word than {w2}", "Yes or no: does '{w1}' contain more letters than '{w2}'?",
               "Tell me yes or no. Is \"{w1}\" longer than \"{w2}\"?"),
}


def _comparison(rng: random.Random, split: str, n: int, seen: set[Any]) -> Iterator[Probe]:
    tasks = list(_COMPARE_TEMPLATES)
    pool = _pool(WORDS, split, lambda w: "word|" + w)
    made = 0
    while made < n:
        task = tasks[made % len(tasks)]
        size = rng.choice((1, 2, 3))
        a, b = _digits(rng, size), _digits(rng, size)
        w1, w2 = rng.sample(pool, 2)
        if a == b or (task == "longer" and len(w1) == len(w2)) or w1[0] == w2[0]:
            continue
        key = (task, a) if task == "even" else (task, a, b) if task in ("greater", "less") else (task, w1, w2)
        if key in seen:
            continue
        seen.add(key)
        truth = {"greater": a > b, "less": a < b, "even": a % 2 == 0, "before": w1 < w2, "longer": len(w1) > len(w2)}[task]
        level = size if task in ("greater", "less", "even") else 2
        template = rng.choice(_templates(_COMPARE_TEMPLATES[task], split))
        yield Probe("", "comparison", task, level, split, template.format(a=a, b=b, w1=w1, w2=w2), "yesno", "yes" if truth else "no")
        made += 1


# ---- short rewrites ---------------------------------------------------------------------------

_SENTENCES_TO_COPY = (
    "The cat sat on the mat.", "Meet me at the station at noon.", "Blue whales are the largest animals.",
    "Please close the window before you leave.", "The train to Boston leaves at seven.", "I like green tea with honey.",
    "Our team won the match on Sunday.", "The library opens at nine.", "Water boils at one hundred degrees.",
    "She planted roses in the garden.", "The meeting has been moved to Friday.", "Turn left after the bridge.",
    "My brother plays the violin.", "The museum is closed on Mondays.", "Bring an umbrella, it might rain.",
    "The package arrived this morning.", "He painted the fence white.", "Dinner is ready at eight.",
    "The children built a sandcastle.", "Save your work before closing the file.", "The river froze last winter.",
    "Birds fly south in the autumn.", "The password must have twelve characters.", "Lunch will be served in the hall.",
    "The store sells fresh bread daily.", "We hiked to the top of the hill.", "The printer is out of paper.",
    "Call me when you get home.", "The old bridge was rebuilt in stone.", "Coffee is served with milk.",
)
_PLURALS = (
    ("box", "boxes"), ("child", "children"), ("mouse", "mice"), ("city", "cities"), ("knife", "knives"),
    ("tooth", "teeth"), ("foot", "feet"), ("man", "men"), ("woman", "women"), ("baby", "babies"), ("leaf", "leaves"),
    ("bus", "buses"), ("glass", "glasses"), ("dish", "dishes"), ("story", "stories"), ("wolf", "wolves"),
    ("goose", "geese"), ("person", "people"), ("potato", "potatoes"), ("tomato", "tomatoes"), ("church", "churches"),
    ("party", "parties"), ("half", "halves"), ("hero", "heroes"), ("city", "cities"), ("fox", "foxes"),
    ("lady", "ladies"), ("wish", "wishes"), ("life", "lives"), ("ox", "oxen"), ("cactus", "cacti", "cactuses"),
    ("fly", "flies"), ("key", "keys"), ("toy", "toys"), ("shelf", "shelves"), ("class", "classes"),
)
_PAST = (
    ("go", "went"), ("eat", "ate"), ("run", "ran"), ("see", "saw"), ("write", "wrote"), ("take", "took"),
    ("swim", "swam"), ("sing", "sang"), ("buy", "bought"), ("think", "thought"), ("bring", "brought"),
    ("teach", "taught"), ("catch", "caught"), ("fly", "flew"), ("drink", "drank"), ("speak", "spoke"),
    ("break", "broke"), ("choose", "chose"), ("drive", "drove"), ("ride", "rode"), ("walk", "walked"),
    ("play", "played"), ("jump", "jumped"), ("cry", "cried"), ("stop", "stopped"), ("make", "made"),
    ("give", "gave"), ("find", "found"), ("sleep", "slept"), ("leave", "left"), ("begin", "began"), ("know", "knew"),
)
_REWRITE_TEMPLATES: dict[str, tuple[str, ...]] = {
    "repeat": ("Repeat exactly: {x}", "Please repeat this sentence word for word: {x}", "Copy this text: \"{x}\"",
               "say this back to me exactly: {x}", "Echo the following sentence without changes: {x}"),
    "lowercase": ("Rewrite this in lowercase: {X}", "Convert to lower case: {X}", "make this lowercase: {X}",
                  "Please write the following in small letters: {X}", "Change this text to all lowercase letters: {X}"),
    "plural": ("What is the plural of '{x}'?", "Make the word {x} plural.", "plural of {x}?",
               "Give me the plural form of \"{x}\".", "One {x}, two ... what? Give the plural."),
    "past": ("What is the past tense of '{x}'?", "Put the verb {x} in the past tense.", "past tense of {x}?",
             "Give me the simple past form of \"{x}\".", "Yesterday I ... ({x}). Which past form goes there?"),
}


def _rewrite(rng: random.Random, split: str, n: int, seen: set[Any]) -> Iterator[Probe]:
    pools: dict[str, list[Any]] = {
        "repeat": _pool(_SENTENCES_TO_COPY, split, lambda s: "copy|" + s),
        "lowercase": _pool(_SENTENCES_TO_COPY, split, lambda s: "lower|" + s),
        "plural": _pool(_PLURALS, split, lambda r: "plural|" + r[0]),
        "past": _pool(_PAST, split, lambda r: "past|" + r[0]),
    }
    tasks = list(_REWRITE_TEMPLATES)
    made = 0
    while made < n:
        task = tasks[made % len(tasks)]
        item = rng.choice(pools[task])
        template = rng.choice(_templates(_REWRITE_TEMPLATES[task], split))
        key = (task, item, template)  # small pools: an item may come back, in another phrasing
        if key in seen:
            continue
        seen.add(key)
        if task in ("repeat", "lowercase"):
            text = str(item)
            prompt = template.format(x=text, X=text.upper())
            answer = text if task == "repeat" else text.lower()
            yield Probe("", "rewrite", task, 1 + (task == "lowercase") + (len(text) > 30), split, prompt,
                        "repeat" if task == "repeat" else "repeat_case", answer)
        else:
            word, form, *more = item
            yield Probe("", "rewrite", task, 2, split, template.format(x=word), "mention", form, tuple(more))
        made += 1


# ---- science multiple choice (ARC train subset) -----------------------------------------------

_MC_TEMPLATES = (
    "{q}\n{opts}\nAnswer with the letter of the correct option.",
    "{q}\n\n{opts}",
    "Question: {q}\nOptions:\n{opts}\nAnswer:",
    "{q} Choose one:\n{opts}",
    "Pick the right answer.\n{q}\n{opts}\nReply with A, B, C or D.",
    "Science quiz! {q}\n{opts}\nWhich one is correct?",
)


def load_arc_subset(path: str | Path | None = None) -> list[dict[str, Any]]:
    p = package_dir() / ARC_FILE if path is None else Path(path)
    with p.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _science(rng: random.Random, split: str, n: int, seen: set[Any]) -> Iterator[Probe]:
    pool = _pool(load_arc_subset(), split, lambda r: "arc|" + str(r["id"]))
    rng.shuffle(pool)
    for row in pool[:n]:
        labels = "ABCD"
        opts = "\n".join(f"{labels[i]}. {text}" for i, text in enumerate(row["choices"]))
        template = rng.choice(_templates(_MC_TEMPLATES, split))
        level = 1 if row["source"] == "easy" else 3
        yield Probe("", "science_mc", row["source"], level, split, template.format(q=row["question"], opts=opts),
                    "choice", row["answer"], choices=tuple(row["choices"]))


_GENERATORS: dict[str, Callable[[random.Random, str, int, set[Any]], Iterator[Probe]]] = {
    "arithmetic": _arithmetic, "facts": _facts, "word": _words, "extraction": _extraction,
    "comparison": _comparison, "rewrite": _rewrite, "science_mc": _science,
}


def generate_probes(seed: int = DEFAULT_SEED, per_family: dict[str, int] | None = None) -> list[Probe]:
    """Both splits, calibration first; the same seed always gives the same list."""
    sizes = per_family or PER_FAMILY
    out: list[Probe] = []
    for family in FAMILIES:
        seen: set[Any] = set()  # shared across splits: no generated instance appears in both
        for offset, split in enumerate(SPLITS):
            rng = random.Random(f"{seed}|{family}|{offset}")
            for i, probe in enumerate(_GENERATORS[family](rng, split, sizes[split], seen)):
                out.append(_with_id(probe, f"{family}/{split}/{i:04d}"))
    return out


def _with_id(probe: Probe, probe_id: str) -> Probe:
    row = probe.to_json()
    row["id"] = probe_id
    return Probe.from_json(row)


def build_arc_subset(data_dir: str | Path, per_source: int = 150, seed: int = DEFAULT_SEED) -> list[dict[str, Any]]:
    """The shipped ARC subset: four-option questions from the ARC *train* files only (validation is held out)."""
    rows: list[dict[str, Any]] = []
    for source, name in (("easy", "arc_easy_train.jsonl"), ("challenge", "arc_challenge_train.jsonl")):
        with (Path(data_dir) / name).open(encoding="utf-8") as fh:
            items = [json.loads(line) for line in fh if line.strip()]
        items = [r for r in items if list(r["choices"]["label"]) == ["A", "B", "C", "D"]]
        items.sort(key=lambda r: str(r["id"]))
        random.Random(f"{seed}|arc|{source}").shuffle(items)
        for r in items[:per_source]:
            rows.append({"id": r["id"], "source": source, "question": r["question"],
                         "choices": list(r["choices"]["text"]), "answer": r["answerKey"]})
    return rows


def summarise(probes: Iterable[Probe]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for p in probes:
        counts.setdefault(p.split, {}).setdefault(p.family, 0)
        counts[p.split][p.family] += 1
    return counts
