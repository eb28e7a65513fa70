"""The docs tree: generated tables match the code, every relative link and anchor resolves, no lab notes."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HISTORY = re.compile(r"issue [0-9]+|\blent\b|session of 20", re.IGNORECASE)
DATE = re.compile(r"(?<![\w.])20[0-9]{2}-[01][0-9]-[0-3][0-9](?![\w-])")


def gen_docs():  # tools/ is not a package
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_docs", module)
    spec.loader.exec_module(module)
    return module


def prose(path: Path) -> str:
    """The page without its fenced code blocks (links and headings in code are not links)."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text stays
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(path), re.MULTILINE):
        base = slug(m[1])
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text()))
    return out


def test_slug_follows_github() -> None:
    assert slug("Demand-aware replicas (`spec.autoscaling`)") == "demand-aware-replicas-specautoscaling"
    assert slug("GitOps (Argo CD, Flux)") == "gitops-argo-cd-flux"
    assert slug("Side by side with llama.cpp (`make bench-peers`)") == "side-by-side-with-llamacpp-make-bench-peers"


def test_generated_tables_are_current() -> None:
    """A flag, env var, chart value or make target in the code and not in docs/ (or the reverse) fails here."""
    gen = gen_docs()
    used = {m[2] for p in gen.doc_files() for m in gen.BLOCK.finditer(p.read_text())}
    assert used == set(gen.SECTIONS), f"sections without a place in docs/: {sorted(set(gen.SECTIONS) - used)}"
    stale = [str(p.relative_to(ROOT)) for p in gen.stale()]
    assert not stale, f"generated tables out of date in {stale}: run `make docs`"


def test_generated_blocks_are_closed() -> None:
    for page in PAGES:
        text = page.read_text()
        assert text.count("<!-- BEGIN GENERATED:") == text.count("<!-- END GENERATED -->"), page


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, broken


def test_docs_index_links_every_page() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    linked = {(ROOT / "docs" / t.partition("#")[0]).resolve() for t in LINK.findall(index)}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md") if p.name != "index.md"}
    assert not pages - linked, sorted(str(p.relative_to(ROOT)) for p in pages - linked)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_history(page: Path) -> None:
    """History lives in git: no issue numbers, dated passes or lab notes in the docs."""
    text = page.read_text()
    hits = [m[0] for m in HISTORY.finditer(text)]
    hits += [m[0] for m in DATE.finditer(text)]
    assert not hits, hits


SOURCES = [
    "worker", "operator", "jobs", "sidecar", "devcluster", "tools", "charts", "mk", "Makefile", "Dockerfile.worker"
]  # fmt: skip
ENV = re.compile(r"\b(?:LORAFLEET|DYN)_[A-Z0-9_]+\b")


def source_text() -> str:
    files = [p for s in SOURCES for p in ([ROOT / s] if (ROOT / s).is_file() else (ROOT / s).rglob("*"))]
    keep = {".py", ".yaml", ".tpl", ".sh", ".mk", ""}
    return "\n".join(p.read_text(errors="replace") for p in files if p.is_file() and p.suffix in keep)


def test_environment_variables_in_the_docs_exist() -> None:
    code = source_text()
    named = {v for page in PAGES for v in ENV.findall(page.read_text())}
    assert not {v for v in named if v not in code}, sorted(v for v in named if v not in code)


def test_worker_environment_variables_are_documented() -> None:
    """The operator's and router's variables are generated with their flags; the worker's are listed by hand."""
    reference = (ROOT / "docs" / "configuration.md").read_text()
    src = [*(ROOT / "worker" / "src").rglob("*.py"), *(ROOT / "jobs" / "src").rglob("*.py")]
    read = {m for p in src for m in re.findall(r"[\"'](\b(?:LORAFLEET|DYN)_[A-Z0-9_]+)[\"']", p.read_text())}
    assert "DYN_LORA_PATH" in read
    assert not {v for v in read if f"`{v}`" not in reference}, sorted(v for v in read if f"`{v}`" not in reference)


# Pages that document lorafleet's own commands, and the flags of other programs they mention.
FLAG_PAGES = ["README.md", "docs/configuration.md", "docs/operator.md", "docs/worker-api.md",
              "docs/troubleshooting.md", "docs/design/operator.md", "docs/design/router.md"]  # fmt: skip
# vLLM's flags the comparison names, the soak's and bench scripts' own (not in the CLI reference)
NOT_OURS = {"--api-key", "--lora-modules", "--converge-timeout", "--settle", "--fault-every", "--shutdown-timeout",
            "--enable-lora", "--block-size", "--vllm-block-size"}  # fmt: skip


def test_flags_in_the_docs_exist() -> None:
    flags = gen_docs().all_flags()
    assert "--max-loras" in flags and "--default-replicas" in flags
    named = set()
    for page in FLAG_PAGES:
        named |= set(re.findall(r"`(--[a-z][a-z0-9-]*)", prose(ROOT / page)))
    unknown = sorted(named - flags - NOT_OURS)
    assert not unknown, f"flags no CLI has: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_have_as_many_cells_as_columns(page: Path) -> None:
    lines = prose(page).split("\n")
    cells = [len(re.split(r"(?<!\\)\|", line.strip())) - 2 for line in lines]
    ragged = []
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(?:\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                if cells[j] != cells[i]:
                    ragged.append(f"line {j + 1}: {cells[j]} cells under {cells[i]} columns")
                j += 1
    assert not ragged, ragged


def test_readme_is_short_and_points_into_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make demo" in readme and "make test" in readme
    assert "docs/index.md" in readme
    assert "```mermaid" in readme
