"""Prompts for the end-to-end tests: deterministic token ids."""

from __future__ import annotations

import random

BLOCK = 128  # vLLM's block size on the CPU backend


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(length)]


def prompt(token_ids: list[int], cache_salt: str | None = None) -> dict:
    return {"tokens": token_ids, "cache_salt": cache_salt}
