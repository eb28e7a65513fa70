"""Which of an adapter's holders gets a request: fewest in flight, or cache-aware (SGLang's router policy).

`CacheAware` keeps, per model name and endpoint, an approximate prefix tree of the prompts it routed there:
the prompt text is cut into chunks of `chunk_chars` characters, each chunk named by a hash chained over the
model name and the chunks before it (as the workers name KV blocks), and each endpoint remembers up to
`max_chunks` such names, least recently routed dropped first. A request goes to the endpoint that matched
the most leading chunks of its prompt (its KV most likely still cached there), if at least `min_match` of
the prompt matched and that endpoint is not overloaded: with this request, its in-flight requests stay within
`balance` times the mean over the candidates, rounded up (consistent hashing with bounded loads).
Otherwise, and for prompts shorter than a chunk, it goes to the endpoint with the fewest requests in
flight (ties at random); the prompt is then remembered there.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Route:
    """What a policy may look at: the requested model and the prompt text it starts with."""

    model: str
    text: str = ""


def route_of(payload: Mapping[str, Any]) -> Route:
    """The route of an OpenAI request body: `prompt` (completions; the first of a list) or `messages` (chat)."""
    model = str(payload.get("model", ""))
    if "messages" in payload:
        # tools come first in a chat template; messages in order make later turns extend earlier ones
        head = json.dumps(payload.get("tools") or [], sort_keys=True)
        return Route(model, head + json.dumps(payload["messages"], sort_keys=True)[:-1])
    prompt = payload.get("prompt", "")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    return Route(model, prompt if isinstance(prompt, str) else " ".join(map(str, prompt)))


class RoutingPolicy(Protocol):
    def choose(self, endpoints: Sequence[str], inflight: Mapping[str, int], route: Route | None) -> str:
        """One of `endpoints` (not empty) for `route` (None when the request has none)."""
        ...

    def forget(self, endpoint: str) -> None:
        """Drop what the policy remembers of `endpoint` (its pod went away)."""
        ...


def fewest_in_flight(endpoints: Sequence[str], inflight: Mapping[str, int]) -> str:
    fewest = min(inflight.get(e, 0) for e in endpoints)
    return random.choice([e for e in endpoints if inflight.get(e, 0) == fewest])


class FewestInFlight:
    """The holder with the fewest requests in flight through this router."""

    def choose(self, endpoints: Sequence[str], inflight: Mapping[str, int], route: Route | None) -> str:
        return fewest_in_flight(endpoints, inflight)

    def forget(self, endpoint: str) -> None:
        """Nothing to forget: this policy keeps no history."""


class CacheAware:
    """Prefix affinity per model within a load bound, else fewest in flight (see the module docstring)."""

    def __init__(
        self, *, chunk_chars: int = 64, max_chunks: int = 100_000, min_match: float = 0.5, balance: float = 1.25
    ) -> None:
        if chunk_chars < 1 or max_chunks < 1 or not 0 <= min_match <= 1 or balance < 1:
            raise ValueError("chunk_chars and max_chunks must be >= 1, min_match in [0, 1], balance >= 1")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.min_match = min_match
        self.balance = balance
        self._seen: dict[str, OrderedDict[bytes, None]] = {}  # endpoint -> chunk names, least recent first
        self.affinity_hits = 0  # requests routed by prefix (for tests and the benchmark)

    def chunk_names(self, route: Route) -> list[bytes]:
        names, parent = [], hashlib.sha256(route.model.encode()).digest()
        text, size = route.text, self.chunk_chars
        for start in range(0, len(text) - size + 1, size):
            parent = hashlib.sha256(parent + text[start : start + size].encode()).digest()
            names.append(parent)
        return names

    def matched(self, endpoint: str, names: Sequence[bytes]) -> int:
        """How many leading chunks of `names` were routed to `endpoint` (and not forgotten)."""
        seen = self._seen.get(endpoint)
        if not seen:
            return 0
        n = 0
        for name in names:
            if name not in seen:
                break
            n += 1
        return n

    def choose(self, endpoints: Sequence[str], inflight: Mapping[str, int], route: Route | None) -> str:
        names = self.chunk_names(route) if route is not None else []
        chosen = None
        if names and len(endpoints) > 1:
            bound = math.ceil(self.balance * (sum(inflight.get(e, 0) for e in endpoints) + 1) / len(endpoints))
            best, best_len = None, 0
            for e in endpoints:
                n = self.matched(e, names)
                if n > best_len or (n == best_len and best is not None and inflight.get(e, 0) < inflight.get(best, 0)):
                    best, best_len = e, n
            if best is not None and best_len >= self.min_match * len(names) and inflight.get(best, 0) + 1 <= bound:
                chosen = best
                self.affinity_hits += 1
        if chosen is None:
            chosen = fewest_in_flight(endpoints, inflight)
        self._remember(chosen, names)
        return chosen

    def _remember(self, endpoint: str, names: Sequence[bytes]) -> None:
        seen = self._seen.setdefault(endpoint, OrderedDict())
        for name in names:
            seen[name] = None
            seen.move_to_end(name)
        while len(seen) > self.max_chunks:
            seen.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        """Drop what was routed to `endpoint` (e.g. its pod went away)."""
        self._seen.pop(endpoint, None)


def make_policy(name: str, *, balance: float = 1.25, min_match: float = 0.5) -> RoutingPolicy:
    """`cache-aware` (default; `balance` and `min_match` are its knobs) or `fewest-in-flight`."""
    if name == "cache-aware":
        return CacheAware(balance=balance, min_match=min_match)
    if name == "fewest-in-flight":
        return FewestInFlight()
    raise ValueError(f"unknown router policy {name!r}; choose cache-aware or fewest-in-flight")
