"""Render docs/reference/settings.md: every setting of the gateway, from its settings models.

The gateway's settings (`gateway/settings.py`, whose `edge` section is the engine's own
`edge_engine/settings.py` model) are walked field by field: each setting's dotted name, type and
bounds, shipped default (`gateway/defaults.yaml` where it lists one, else the model's) and the
field's description. A setting without a description stops the render, so a new setting cannot
be added undocumented. The policy sections follow as shipped (`policies/defaults/*.yaml`, their
comments being their documentation). A test renders it afresh and compares it with the
committed page.

    .venv/bin/python docs/gen_settings.py            # rewrite docs/reference/settings.md
    .venv/bin/python docs/gen_settings.py --check    # exit 1 when it is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, TypeGuard, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gateway.settings import Settings  # noqa: E402

OUT = REPO / "docs" / "reference" / "settings.md"
NO_DEFAULT = object()


def _is_model(tp: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _entry_model(tp: Any) -> tuple[str, type[BaseModel]] | None:
    """For `list[Model]` or `dict[str, Model]`: the suffix of its entries' names and the model."""
    args = get_args(tp)
    if get_origin(tp) is list and args and _is_model(args[0]):
        return "[]", args[0]
    if get_origin(tp) is dict and len(args) == 2 and _is_model(args[1]):
        return ".<name>", args[1]
    return None


def type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " \\| ".join(json.dumps(a) if isinstance(a, str) else str(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if get_origin(tp) is list:
        return f"list of {type_name(get_args(tp)[0])}"
    if get_origin(tp) is dict:
        key, value = get_args(tp)
        return f"map of {type_name(key)} to {type_name(value)}"
    if _is_model(tp):
        return "section"
    if tp is Any:
        return "any"
    return {"Path": "path", "str": "string"}.get(getattr(tp, "__name__", str(tp)), getattr(tp, "__name__", str(tp)))


def bounds(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            parts.append(f">= {item.ge}")
        elif isinstance(item, annotated_types.Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Le):
            parts.append(f"<= {item.le}")
        elif isinstance(item, annotated_types.Lt):
            parts.append(f"< {item.lt}")
        if isinstance(item, annotated_types.MinLen):
            parts.append(f"at least {item.min_length} long")
    return ", ".join(parts)


def value_text(value: Any) -> str:
    if value is NO_DEFAULT:
        return "required"
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def model_default(field: FieldInfo) -> Any:
    """The model's default; a factory's value when it makes a list or a map (not a machine's figure)."""
    if field.default_factory is not None:
        made = field.default_factory()  # type: ignore[call-arg]
        return made if isinstance(made, list | dict) else "computed at start (see meaning)"
    return NO_DEFAULT if field.is_required() else field.default


def shipped(defaults: Any, path: list[str]) -> Any:
    for key in path:
        if not isinstance(defaults, dict) or key not in defaults:
            return NO_DEFAULT
        defaults = defaults[key]
    return defaults


def describe(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or "").strip()
    return doc.split("\n\n")[0].replace("\n", " ") if doc else ""


def sections(model: type[BaseModel], name: str, defaults: Any, path: list[str] | None) -> Iterator[tuple[str, str, list[list[str]]]]:
    """(section name, its description, rows) for `model` and every section inside it, in field order.

    `path` is where the section's shipped defaults lie in gateway/defaults.yaml; None for the
    entries of a list or map (an upstream, a pool), whose defaults are the model's own.
    """
    rows: list[list[str]] = []
    inner: list[tuple[type[BaseModel], str, list[str] | None]] = []
    for key, field in model.model_fields.items():
        if field.exclude:
            continue
        tp = field.annotation
        dotted = f"{name}.{key}" if name else key
        if _is_model(tp):
            inner.append((tp, dotted, None if path is None else [*path, key]))
            continue
        entry = _entry_model(tp)
        if entry:  # a list or map of sections: its entries get a section of their own, not a row
            inner.append((entry[1], dotted + entry[0], None))
            continue
        if not field.description:
            raise ValueError(f"setting {dotted} has no description: add one to its Field in the settings model")
        default = NO_DEFAULT if path is None else shipped(defaults, [*path, key])
        if default is NO_DEFAULT:
            default = model_default(field)
        kind = type_name(tp) + (f" ({b})" if (b := bounds(field)) else "")
        rows.append([f"`{dotted}`", kind, value_text(default), field.description.replace("|", "\\|")])
    yield name, describe(model), rows
    for sub, dotted, sub_path in inner:
        yield from sections(sub, dotted, defaults, sub_path)


def render() -> str:
    defaults = yaml.safe_load((REPO / "gateway" / "defaults.yaml").read_text(encoding="utf-8"))
    lines = [
        "# Settings reference",
        "",
        "Generated by `docs/gen_settings.py` from the settings models (`gateway/settings.py`, and",
        "`edge_engine/settings.py` for the `edge` section) and the shipped defaults (`gateway/defaults.yaml`,",
        "`policies/defaults/*.yaml`); `make docs` renders it afresh and the tests fail where it differs. How a",
        "file, the environment and the policy sections combine is in [Configuration](../configuration.md).",
        "",
        "Every section is strict: a misspelt key stops the start with its dotted path.",
        "",
    ]
    for name, about, rows in sections(Settings, "", defaults, []):
        lines += [f"## {name or 'Top level'}", ""]
        if about:
            lines += [about, ""]
        if not rows:
            continue
        lines += ["| setting | type | default | meaning |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    lines += [
        "## Policy sections",
        "",
        "The policy (`policy_file`, `TIERLANE_POLICY`, or inline under `policy:`) is one section per",
        "concern, each a strict model; these are the shipped files, merged in name order. Each section",
        "may carry `overrides:` rules `{match: {tenant|app|model|lane: value-or-list}, set: {...}}`.",
        "",
    ]
    for path in sorted((REPO / "policies" / "defaults").glob("*.yaml")):
        lines += [f"### {path.stem}", "", f"`policies/defaults/{path.name}`:", "", "```yaml"]
        lines += path.read_text(encoding="utf-8").rstrip("\n").split("\n")
        lines += ["```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the page would change")
    args = parser.parse_args(argv)
    text = render()
    old = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
    if args.check:
        if old != text:
            print(f"{args.out} is out of date: run docs/gen_settings.py", file=sys.stderr)
            return 1
        return 0
    if old != text:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    print(f"{'updated' if old != text else 'unchanged'}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
