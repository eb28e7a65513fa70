"""Write the reference tables of docs/ from the code they describe (`make docs`).

Each generated table sits between two markers in a Markdown file under docs/:

    <!-- BEGIN GENERATED: operator-flags -->
    ...
    <!-- END GENERATED -->

and is rewritten from its source:

- `*-flags`: the argparse parser of a console script. The script is found by name in the
  `[project.scripts]` tables of the repository's `pyproject.toml` files, so a CLI that moves to
  another package keeps its table. The parser is the module's `build_parser()` when it has one,
  else the one the entry point builds (caught at `parse_args`, before it does anything else).
  A flag's environment variable and default are read from its help text's "(env X, default Y)".
- `chart-values`: `charts/lorafleet/values.yaml`, each key with the `# --` comment above it (or
  its inline comment), as helm-docs reads them.
- `make-targets`: the `## ` comments of the Makefile and mk/*.mk, what `make help` prints.

    python tools/gen_docs.py            # rewrite the tables in place
    python tools/gen_docs.py --check    # exit 1 and name the stale tables (tests/delivery/test_docs.py)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- BEGIN GENERATED: ([a-z0-9-]+) -->\n)(.*?)(<!-- END GENERATED -->)", re.DOTALL)
ENV_DEFAULT = re.compile(r"\s*\(env (?P<env>[A-Z][A-Z0-9_]*)(?:, default (?P<default>.*))?\)\s*$")
# Chart values documented as one object, not key by key.
OPAQUE = {"resources", "podSecurityContext", "containerSecurityContext", "strategy", "volume"}


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---- console scripts -------------------------------------------------------------------------


def console_scripts() -> dict[str, str]:
    """Script name -> "module:function", from every pyproject.toml one or two levels down."""
    scripts: dict[str, str] = {}
    for pyproject in sorted([*ROOT.glob("*/pyproject.toml"), *ROOT.glob("*/*/pyproject.toml")]):
        if ".venv" in pyproject.parts:
            continue
        scripts.update(tomllib.loads(pyproject.read_text()).get("project", {}).get("scripts", {}))
    return scripts


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@contextlib.contextmanager
def clean_environment() -> Iterator[None]:
    """Without lorafleet's and Dynamo's variables: some defaults are read from them, and the docs
    show the defaults a fresh process has."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith(("LORAFLEET_", "DYN_"))]:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def script_parser(script: str) -> argparse.ArgumentParser:
    """The argparse parser of a console script (see the module docstring)."""
    with clean_environment():
        return _script_parser(script)


def _script_parser(script: str) -> argparse.ArgumentParser:
    module_name, func_name = console_scripts()[script].split(":")
    module = importlib.import_module(module_name)
    if callable(getattr(module, "build_parser", None)):
        parser = module.build_parser()
        if isinstance(parser, argparse.ArgumentParser):
            return parser

    def catch(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Caught(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args, sys.argv
    argparse.ArgumentParser.parse_args = catch  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = catch  # type: ignore[method-assign]
    sys.argv = [script]
    try:
        getattr(module, func_name)()
    except _Caught as caught:
        return caught.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args, sys.argv = saved
    raise RuntimeError(f"{script}: its entry point parsed no arguments")


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def all_flags() -> set[str]:
    """Every option string of every console script of the repository, subcommands included."""
    flags: set[str] = set()
    for script in console_scripts():
        parsers = [script_parser(script)]
        while parsers:
            parser = parsers.pop()
            for action in parser._actions:
                flags.update(action.option_strings)
                if isinstance(action, argparse._SubParsersAction):
                    parsers.extend(action.choices.values())
    return flags


def options(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, str, str]]:
    """(flags, env, default, help) of each option, help excluded."""
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        help_text = (action.help or "").replace("%%", "%")
        env = default = ""
        found = ENV_DEFAULT.search(help_text)
        if found:
            help_text = help_text[: found.start()]
            env = found["env"]
            default = found["default"] or ""
        if not default and action.default not in (None, argparse.SUPPRESS, False):
            default = repr(action.default) if isinstance(action.default, str) else str(action.default)
        flags = sorted(action.option_strings, key=lambda o: not o.startswith("--"))  # long first, as declared
        if action.metavar and action.nargs != 0 and action.metavar != action.dest.upper():
            flags[0] += f" {action.metavar}"
        elif action.choices and action.nargs != 0:
            flags[0] += " {" + ",".join(map(str, action.choices)) + "}"
        default = default.strip()
        if len(default) >= 2 and default[0] == default[-1] and default[0] in "'\"":
            default = default[1:-1]
        yield ", ".join(flags), env, "" if default in ("()", "None") else default, help_text.strip()


def flags_table(parser: argparse.ArgumentParser) -> str:
    rows = list(options(parser))
    with_env = any(env for _, env, _, _ in rows)
    header = ["flag", *(["environment"] if with_env else []), "default", "meaning"]
    body = [
        [f"`{cell(f)}`", *([f"`{env}`" if env else ""] if with_env else []), f"`{cell(d)}`" if d else "", cell(h)]
        for f, env, d, h in rows
    ]
    return table(header, body)


def script_flags(script: str, sub: str | None = None) -> Callable[[], str]:
    def render() -> str:
        parser = script_parser(script)
        return flags_table(subcommand(parser, sub) if sub else parser)

    return render


# ---- chart values ----------------------------------------------------------------------------

KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")


def _split_inline(rest: str) -> tuple[str, str]:
    value, _, comment = rest.partition(" #")
    return value.strip(), comment.strip().removeprefix("-- ").strip()


def chart_value_docs(path: Path) -> list[tuple[str, bool, str]]:
    """(dotted key, has children, description) for every key of values.yaml, in file order."""
    out: list[tuple[str, bool, str]] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped:
            comment = []
            continue
        if stripped.startswith("#"):
            if stripped.startswith("#  "):  # an indented example, not prose
                continue
            text = stripped.lstrip("#").strip()
            if text.startswith("-- "):
                comment = [text[3:]]
            elif comment:
                comment.append(text)
            continue
        m = KEY.match(line)
        if not m:  # a list item or a continuation
            comment = []
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        value, inline = _split_inline(m["rest"])
        dotted = ".".join([*(k for _, k in stack), m["key"]])
        nxt = next((ln for ln in lines[i + 1 :] if ln.strip() and not ln.strip().startswith("#")), "")
        has_children = not value and len(nxt) - len(nxt.lstrip()) > indent
        out.append((dotted, has_children, " ".join(comment) or inline))
        if has_children:
            stack.append((indent, m["key"]))
        comment = []
    return out


def chart_values() -> str:
    path = ROOT / "charts" / "lorafleet" / "values.yaml"
    values = yaml.safe_load(path.read_text())
    rows = []
    hidden: tuple[str, ...] = ()
    for dotted, has_children, doc in chart_value_docs(path):
        if hidden and dotted.startswith(hidden):
            continue
        value: Any = values
        for part in dotted.split("."):
            value = value[part]
        last = dotted.rsplit(".", 1)[-1]
        if has_children and last not in OPAQUE:
            if doc:
                rows.append([f"`{dotted}`", "", cell(doc)])
            continue
        if has_children:
            hidden = (dotted + ".",)
        default = json.dumps(value, separators=(", ", ": "))
        rows.append([f"`{dotted}`", f"`{cell(default)}`", cell(doc)])
    return table(["value", "default", "meaning"], rows)


# ---- make targets ----------------------------------------------------------------------------

TARGET = re.compile(r"^([a-zA-Z0-9_-]+):.*?## (.*)$", re.MULTILINE)


def makefiles() -> list[Path]:
    return [ROOT / "Makefile", *sorted((ROOT / "mk").glob("*.mk"))]


def make_targets() -> str:
    rows = []
    for path in makefiles():
        for target, doc in TARGET.findall(path.read_text()):
            rows.append([f"`make {target}`", cell(doc.strip()), f"`{path.relative_to(ROOT)}`"])
    return table(["target", "what it does", "defined in"], rows)


SECTIONS: dict[str, Callable[[], str]] = {
    "operator-flags": script_flags("lorafleet-operator"),
    "router-flags": script_flags("lorafleet-router"),
    "worker-flags": script_flags("lorafleet-worker", "serve"),
    "sync-flags": script_flags("lorafleet-sync"),
    "sidecar-flags": script_flags("lorafleet-vllm-sidecar"),
    "chart-values": chart_values,
    "make-targets": make_targets,
}


def doc_files() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def render(text: str, cache: dict[str, str], keep_failed: bool = False) -> str:
    """``text`` with each generated section rewritten; ``keep_failed`` keeps a section whose source
    cannot be read (say, a CLI that does not import) as it is, with a warning, instead of raising."""

    def replace(m: re.Match[str]) -> str:
        name = m[2]
        if name not in SECTIONS:
            raise KeyError(f"unknown generated section {name!r} (known: {', '.join(SECTIONS)})")
        if name not in cache:
            try:
                cache[name] = SECTIONS[name]()
            except Exception as e:
                if not keep_failed:
                    raise
                print(f"warning: {name} not regenerated: {type(e).__name__}: {e}", file=sys.stderr)
                return m[0]
        return m[1] + cache[name] + m[4]

    return BLOCK.sub(replace, text)


def stale(files: list[Path] | None = None) -> list[Path]:
    """The files whose generated sections differ from what the code gives now."""
    cache: dict[str, str] = {}
    return [p for p in files or doc_files() if (t := p.read_text()) != render(t, cache)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only report stale files; exit 1 if any")
    args = ap.parse_args(argv)
    cache: dict[str, str] = {}
    changed = []
    for path in doc_files():
        text = path.read_text()
        new = render(text, cache, keep_failed=not args.check)
        if new != text:
            changed.append(path)
            if not args.check:
                path.write_text(new)
    for path in changed:
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
