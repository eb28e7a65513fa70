"""The adapter catalogue: the adapters this worker may load by itself when an inference request names one
that it does not hold (name -> source URI), as its operator last declared them. Replaced whole, never edited.
"""

from __future__ import annotations

from collections.abc import Mapping


class Catalog:
    """Adapter names and their source URIs; `replace` swaps the whole set at once."""

    def __init__(self) -> None:
        self._entries: dict[str, str] = {}

    def replace(self, entries: Mapping[str, str]) -> None:
        self._entries = dict(entries)

    def uri_of(self, name: str) -> str | None:
        return self._entries.get(name)

    def entries(self) -> dict[str, str]:
        """Every catalogued name and its URI, by name."""
        return dict(sorted(self._entries.items()))

    def __len__(self) -> int:
        return len(self._entries)
