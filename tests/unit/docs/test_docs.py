"""The documentation: `mkdocs build --strict` passes (no broken link or anchor, no page left out of
the navigation), the generated settings reference is current and documents every setting, the
configuration page lists every environment variable the gateway reads, and the README stays a
short front page whose links all land."""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from docs.gen_settings import render, sections

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs"
README = REPO / "README.md"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `make docs` builds it (strict), into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


class _Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids.update(value for name, value in attrs if name == "id" and value)


def _ids(html: Path) -> set[str]:
    parser = _Ids()
    parser.feed(html.read_text(encoding="utf-8"))
    return parser.ids


def _built_page(site: Path, page: str) -> Path:
    """The HTML file MkDocs makes of docs/<page> (use_directory_urls: a.md -> a/index.html)."""
    stem = page.removesuffix(".md")
    return site / (f"{stem.removesuffix('index')}index.html" if stem.endswith("index") else f"{stem}/index.html")


def test_the_site_builds_strictly_with_every_page_in_the_navigation(site: Path) -> None:
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert "index.md" in pages and "reference/settings.md" in pages and "results/index.md" in pages
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    for page in pages:  # --strict with validation.omitted_files fails on these too; named here for the message
        assert f" {page}" in nav, f"docs/{page} is not in mkdocs.yml's nav"
        assert _built_page(site, page).is_file(), f"docs/{page} was not built"


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md) and [no such part](#nowhere)\n")
    (docs / "orphan.md").write_text("# Not in the nav\n")
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:")[0]
    (tmp_path / "mkdocs.yml").write_text(config + "\nnav:\n  - Home: index.md\n")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    for complaint in ("missing.md", "#nowhere", "orphan.md"):
        assert complaint in done.stderr, f"the strict build did not name {complaint}:\n{done.stderr}"


def test_the_settings_reference_is_the_one_the_settings_models_render() -> None:
    committed = (DOCS / "reference" / "settings.md").read_text(encoding="utf-8")
    assert committed == render(), "docs/reference/settings.md is out of date: run docs/gen_settings.py"


def test_the_settings_reference_lists_every_setting_and_every_policy_section() -> None:
    text = render()
    for name in ("server.port", "auth.keys[].admin_scope", "upstreams[].metrics_url", "pools.<name>.balance",
                 "edge.n_ctx", "edge.speculative.max_draft", "edge.grammar.max_rules", "state.on_outage", "model_aliases"):  # fmt: skip
        assert f"| `{name}` |" in text, name
    for path in (REPO / "policies" / "defaults").glob("*.yaml"):
        assert f"### {path.stem}\n" in text and path.read_text(encoding="utf-8").strip() in text


def test_a_setting_without_a_description_stops_the_render() -> None:
    class Inner(BaseModel):
        limit: int = Field(3, ge=1, description="how many")
        bare: bool = False

    class Outer(BaseModel):
        inner: Inner = Field(default_factory=Inner)

    with pytest.raises(ValueError, match="setting inner.bare has no description"):
        list(sections(Outer, "", {}, []))


def test_defaults_come_from_the_shipped_file_then_the_model() -> None:
    class Section(BaseModel):
        """A section."""

        limit: int = Field(3, ge=1, description="how many")
        names: list[str] = Field(default_factory=lambda: ["a"], description="which")

    class Top(BaseModel):
        part: Section = Field(default_factory=Section)

    found = {name: rows for name, _, rows in sections(Top, "", {"part": {"limit": 5}}, [])}
    assert found["part"] == [["`part.limit`", "int (>= 1)", "`5`", "how many"], ["`part.names`", "list of string", '`["a"]`', "which"]]


def test_every_environment_variable_the_gateway_reads_is_documented() -> None:
    read = set(re.findall(r"\"(TIERLANE_[A-Z_]+)\"", (REPO / "gateway" / "settings.py").read_text(encoding="utf-8")))
    documented = set(re.findall(r"`(TIERLANE_[A-Z_]+)`", (DOCS / "configuration.md").read_text(encoding="utf-8")))
    assert read and read <= documented, f"not in docs/configuration.md's environment table: {sorted(read - documented)}"


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = README.read_text(encoding="utf-8").split("\n")
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move reference text into docs/"
    assert lines[:6] == [
        "# tierlane",
        "",
        "```sh",
        "make run     # set up .venv, install, start the gateway on its embedded defaults at http://127.0.0.1:8080/v1",
        "make test    # set up .venv with test extras, run the whole test suite",
        "```",
    ]


def test_every_link_of_the_readme_lands(site: Path) -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text(encoding="utf-8"))
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/results/") for link in local), "the README links no measured figure"
    for link in local:
        path, _, anchor = link.partition("#")
        assert (REPO / path).exists(), f"README.md links {link}: no such file"
        if anchor:
            assert path.startswith("docs/") and path.endswith(".md"), link
            built = _built_page(site, path.removeprefix("docs/"))
            assert anchor in _ids(built), f"README.md links {link}: no such heading on that page"
