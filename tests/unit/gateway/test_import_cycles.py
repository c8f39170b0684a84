"""The import-linter contract that keeps gateway/ free of import cycles (tests/support/import_contracts.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp
import pytest

from tests.support.import_contracts import AcyclicModulesContract, Circle, circles

ROOT = Path(__file__).resolve().parents[3]


def _graph(*imports: tuple[str, str]) -> grimp.ImportGraph:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e", "pkg.f", "other", "other.x"):
        graph.add_module(module)
    for number, (importer, imported) in enumerate(imports, start=1):
        graph.add_import(importer=importer, imported=imported, line_number=number, line_contents=f"import {imported}")
    return graph


def _contract(*containers: str) -> AcyclicModulesContract:
    return AcyclicModulesContract(name="acyclic", session_options={}, contract_options={"containers": list(containers)})


def test_each_circle_is_found_once_with_a_cycle_through_it() -> None:
    graph = _graph(
        ("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"),  # a circle of three
        ("pkg.d", "pkg.a"),  # imports into the circle, not part of it
        ("pkg", "pkg.e"), ("pkg.e", "pkg"),  # a package's __init__ and its own module
        ("pkg.f", "other.x"), ("other.x", "pkg.f"),  # through another package: not this one's circle
    )
    assert circles(graph, ["pkg"]) == [
        Circle(modules=("pkg", "pkg.e"), cycle=("pkg", "pkg.e")),
        Circle(modules=("pkg.a", "pkg.b", "pkg.c"), cycle=("pkg.a", "pkg.b", "pkg.c")),
    ]
    # seen from both packages, the path through other.x is a circle
    assert Circle(modules=("other.x", "pkg.f"), cycle=("other.x", "pkg.f")) in circles(graph, ["pkg", "other"])


def test_the_cycle_named_is_a_shortest_one() -> None:
    graph = _graph(("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"), ("pkg.a", "pkg.c"))
    assert circles(graph, ["pkg"]) == [Circle(modules=("pkg.a", "pkg.b", "pkg.c"), cycle=("pkg.a", "pkg.c"))]


def test_a_graph_without_cycles_has_no_circle() -> None:
    graph = _graph(("pkg", "pkg.a"), ("pkg.a", "pkg.b"), ("pkg.a", "pkg.c"), ("pkg.b", "pkg.c"), ("pkg.c", "other.x"))
    assert circles(graph, ["pkg"]) == []
    assert _contract("pkg").check(graph, verbose=False).kept


def test_the_broken_contract_names_the_cycle_import_by_import(capsys: pytest.CaptureFixture[str]) -> None:
    graph = _graph(("pkg.b", "pkg.c"), ("pkg.c", "pkg.b"), ("pkg.c", "pkg.d"))
    contract = _contract("pkg")
    check = contract.check(graph, verbose=False)
    assert not check.kept
    contract.render_broken_contract(check)
    out = capsys.readouterr().out
    assert "2 modules import each other in a circle: pkg.b, pkg.c." in out
    assert "- pkg.b -> pkg.c (l.1)" in out and "- pkg.c -> pkg.b (l.2)" in out
    assert "pkg.d" not in out


def test_a_container_that_does_not_exist_is_an_error() -> None:
    with pytest.raises(ValueError, match="no such module: nowhere"):
        _contract("nowhere").check(_graph(), verbose=False)


def test_gateway_is_checked_and_has_no_circle() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert "acyclic_modules: tests.support.import_contracts.AcyclicModulesContract" in config["contract_types"]
    checked = [c for c in config["contracts"] if c["type"] == "acyclic_modules"]
    assert any("gateway" in c["containers"] for c in checked)
    graph = grimp.build_graph(*config["root_packages"])
    assert circles(graph, ["gateway"]) == []
