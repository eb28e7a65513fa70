"""Run by an image's venv python (`python import_all.py PKG... [--may-lack MOD...]`): imports every module
of the given packages and checks that every module any of them imports (also inside functions) can be
found. Prints one JSON object: {"imported": [...], "failed": {module: error}, "missing": {name: [importers]}}.

A module named with --may-lack (an optional extra's package) may be missing but must then only be
imported inside functions: a top-level import of it is reported as a failed import.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import pkgutil
import sys
import traceback


def imported_names(path: str, package: str) -> set[str]:
    """Top-level names of every absolute import in a source file (relative imports are the package's own)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - {package}


def main(argv: list[str]) -> int:
    packages, may_lack = (
        (argv[: argv.index("--may-lack")], argv[argv.index("--may-lack") + 1 :])
        if ("--may-lack" in argv)
        else (argv, [])
    )
    imported: list[str] = []
    failed: dict[str, str] = {}
    missing: dict[str, list[str]] = {}
    for package in packages:
        root = importlib.import_module(package)
        walked = [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]
        modules = [package] + [m for m in walked if not m.endswith(".__main__")]  # __main__ runs the CLI
        for name in modules:
            try:
                module = importlib.import_module(name)
            except Exception:
                failed[name] = traceback.format_exc(limit=3)
                continue
            imported.append(name)
            for dep in imported_names(module.__file__ or "", package):
                if dep not in sys.stdlib_module_names and dep not in may_lack and importlib.util.find_spec(dep) is None:
                    missing.setdefault(dep, []).append(name)
    print(json.dumps({"imported": imported, "failed": failed, "missing": missing}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
