"""The n-gram (prompt lookup) proposer: the tokens that followed an earlier occurrence of the sequence's last
n tokens are its draft.

For n from `max_n` down to `min_n`, the last n tokens of prompt + output are looked up in the tokens before
them (the most recent occurrence wins); the first n that occurs proposes up to `k` of the tokens that
followed it. The search runs over the token ids packed as 32-bit words (`bytes.rfind`, C speed).
"""

from __future__ import annotations

from array import array

_WORD = 4  # bytes per packed token id


class NgramProposer:
    """Proposes draft tokens by prompt lookup."""

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError("need 1 <= min_n <= max_n and k >= 1")
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        """Up to `k` (default: the proposer's) draft tokens to follow `tokens`; [] when no n-gram recurs."""
        k = self.k if k is None else min(k, self.k)
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return []
        packed = array("i", tokens).tobytes()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _find_before(packed, packed[(length - n) * _WORD :], length - 1)
            if start >= 0:
                follow = start + n
                return tokens[follow : follow + k]
        return []


def _find_before(packed: bytes, pattern: bytes, end: int) -> int:
    """Token index of the last occurrence of `pattern` that ends before token `end`, else -1."""
    hi = (end) * _WORD  # the occurrence must end at or before this byte (excludes the suffix itself)
    while True:
        at = packed.rfind(pattern, 0, hi)
        if at < 0:
            return -1
        if at % _WORD == 0:
            return at // _WORD
        hi = at + len(pattern) - 1  # a match across token boundaries: look further left
