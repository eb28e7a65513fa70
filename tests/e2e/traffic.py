"""Steady request load for the e2e tests (client threads that count successes and keep every failure),
and a sampler of cluster state while it runs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import httpx
from lorafleet_devcluster.rawstack import PROMPT


class Load:
    """``clients`` threads sending completions for ``model`` to ``url`` (a `/v1/completions` URL), back
    to back or one every ``pause`` seconds per client (a trickle: paced load, not synchronisation);
    ``headers``: sent with each request (``Release.inference_headers()``: the API key, if any)."""

    def __init__(
        self,
        url: str,
        model: str,
        clients: int,
        pause: float = 0.0,
        tokens: int = 16,
        prompt: object = PROMPT,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.url, self.model, self.pause, self.tokens, self.prompt = url, model, pause, tokens, prompt
        self.headers = dict(headers or {})
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.tokens, "temperature": 0}
        body["ignore_eos"] = True
        with httpx.Client(timeout=60, headers=self.headers) as http:
            while not self._stop.is_set():
                try:
                    r = http.post(self.url, json=body)
                    failure = None if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as e:
                    failure = repr(e)
                with self._lock:
                    if failure is None:
                        self.ok += 1
                    else:
                        self.failures.append(failure)
                self._stop.wait(self.pause)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


class Sampler:
    """Samples `probe()` every `interval` seconds in a thread while in its `with` block (monitoring, not
    synchronisation): the values seen, for bounds over the whole fault."""

    def __init__(self, probe: Callable[[], Any], interval: float = 0.5) -> None:
        self.probe, self.interval, self.seen = probe, interval, list[Any]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # the API may be slow to answer during a fault: no sample
                self.seen.append(self.probe())
            self._stop.wait(self.interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
