"""Settings dataclasses read from the environment (``LORAFLEET_*``) and command-line flags.

Each field of a settings dataclass declares its environment variable and help text once
(``setting``); ``add_arguments`` turns the fields into argparse flags (``--default-replicas``) and
``from_sources`` applies defaults < environment < flags. The operator (``lorafleet_operator.settings``)
and the router (``lorafleet_router.settings``) each have their own dataclass on this base.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self


def setting(default: Any, env: str, help: str, **kw: Any) -> Any:
    """A settings field: its default, its environment variable, its help (``secret=True``: never shown;
    ``fallback_env=("NAME",)``: variables read, in order, when ``env`` is unset)."""
    return field(default=default, metadata={"env": env, "help": help, **kw})


@dataclass(frozen=True)
class EnvSettings:
    """Base of a settings dataclass: construction from env and flags, flags from the fields."""

    def validate(self) -> None:
        """Raise ValueError for values that are each well-formed but wrong (override)."""

    def __repr__(self) -> str:  # never print secrets
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("secret")}
        return f"{type(self).__name__}({shown})"

    @classmethod
    def from_sources(cls, env: Mapping[str, str] | None = None, args: argparse.Namespace | None = None) -> Self:
        """Defaults, overridden by ``env``, overridden by flags given in ``args``."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw: Any = getattr(args, f.name, None) if args is not None else None
            for name in (f.metadata["env"], *f.metadata.get("fallback_env", ())):
                if raw is None and name in env:
                    raw = env[name]
            if raw is not None:
                values[f.name] = _convert(f, raw)
        settings = cls(**values)
        settings.validate()
        return settings

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field; flags not given stay None (``from_sources`` then reads the env)."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f"{f.metadata['help']} (env {f.metadata['env']}"
            help_text += ")" if f.metadata.get("secret") else f", default {f.default!r})"
            if isinstance(f.default, bool):
                parser.add_argument(flag, action="store_true", default=None, help=help_text)
            elif f.name == "namespaces":
                parser.add_argument(
                    "--namespace", "-n", dest="namespaces", action="append", default=None, help=help_text
                )
            else:
                parser.add_argument(flag, default=None, metavar=f.name.upper(), help=help_text)

    @classmethod
    def build_parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
        """A process's command line: one flag per field, and ``--verbose``."""
        parser = argparse.ArgumentParser(prog=prog, description=description)
        cls.add_arguments(parser)
        parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
        return parser


@dataclass(frozen=True, repr=False)  # EnvSettings.__repr__ hides secrets
class WatchScope(EnvSettings):
    """Which namespaces a process watches: the fields the operator and the router share."""

    namespaces: tuple[str, ...] = field(
        default=(), metadata={"env": "LORAFLEET_NAMESPACES", "help": "namespaces to watch (comma list / repeat)"}
    )
    all_namespaces: bool = setting(False, "LORAFLEET_ALL_NAMESPACES", "watch every namespace (cluster-wide)")

    def in_own_namespace(self) -> Self:
        """Unless cluster-wide or given namespaces: the pod's own namespace (POD_NAMESPACE), else "default"."""
        if self.all_namespaces or self.namespaces:
            return self
        return dataclasses.replace(self, namespaces=(os.environ.get("POD_NAMESPACE") or "default",))

    @classmethod
    def from_command_line(cls, parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> Self:
        """Settings from the flags in ``argv`` (made by ``build_parser``) and the environment, in the pod's
        own namespace unless told otherwise; sets up logging (``--verbose``); a bad value is a usage error."""
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        try:
            return cls.from_sources(args=args).in_own_namespace()
        except (ValueError, OSError) as e:
            parser.error(str(e))
            raise  # unreachable

    def watched(self) -> list[str | None]:
        """The namespaces to list and watch (None: every namespace)."""
        return [None] if self.all_namespaces else list(self.namespaces)


def _convert(f: dataclasses.Field[Any], raw: Any) -> Any:
    kind = type(f.default) if f.default is not dataclasses.MISSING else tuple
    if kind is tuple:
        items = raw if isinstance(raw, list | tuple) else [raw]
        return tuple(n.strip() for item in items for n in str(item).split(",") if n.strip())
    if kind is bool:
        return raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes", "on")
    try:
        return kind(raw)
    except ValueError as e:
        raise ValueError(f"{f.metadata['env']} / --{f.name.replace('_', '-')}: {e}") from None
