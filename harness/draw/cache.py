"""Where the harness keeps what outlives a run (the fuzz corpus of failures, hypothesis' example database): a
user cache folder, never the working directory. MOE_LORA_HARNESS_CACHE overrides it."""
from __future__ import annotations

import os
import pathlib

CACHE_ENV = "MOE_LORA_HARNESS_CACHE"


def cache_dir() -> pathlib.Path:
    """$MOE_LORA_HARNESS_CACHE, else $XDG_CACHE_HOME/moe-lora-harness, else ~/.cache/moe-lora-harness."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "moe-lora-harness"


def keep_hypothesis_files_here() -> None:
    """hypothesis' own files (its cache of the constants in our source, a default example database) under
    cache_dir()/hypothesis instead of ./.hypothesis in the working directory, unless the user chose a place
    ($HYPOTHESIS_STORAGE_DIRECTORY). Called where hypothesis is configured for our runs (harness.draw.strategies)."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        return
    from hypothesis.configuration import set_hypothesis_home_dir
    set_hypothesis_home_dir(cache_dir() / "hypothesis")


def fuzz_corpus_dir(name: str, origin: str, level: str) -> pathlib.Path:
    """The corpus of a backend's fuzz failures at one level: keyed by its name and a digest of where it came from
    (`spec.origin`), so that another file's op of the same attribute name does not replay, and see FIXED,
    failures that were never its own."""
    import hashlib
    return cache_dir() / "corpus" / f"{name}-{level}-{hashlib.sha1(origin.encode()).hexdigest()[:8]}"
