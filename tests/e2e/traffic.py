"""Steady request load for the e2e tests: client threads that count successes and keep every failure."""

from __future__ import annotations

import threading

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
