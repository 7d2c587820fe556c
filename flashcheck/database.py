"""Hypothesis's example database for kernel runs: one directory per implementation.

Hypothesis replays saved failures first. Shared by every test of a checkout (its default,
``.hypothesis/``), one bad draw of a self-test, or one broken kernel, kept failing runs
that had nothing to do with it. Here a saved failure is keyed by the implementation that
produced it and replayed only for that implementation; tests without an implementation
(the suite's self-tests) neither read nor write it.

Where: $FLASHCHECK_DB, else ``.flashcheck/examples`` under the directory pytest started in.
A nightly job shares it across runs by caching that folder (examples/ci/).
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase


def key_of(impl) -> str:
    """A folder name per implementation: its name plus a digest of where it was loaded from."""
    from flashcheck.contract import origin_of

    digest = hashlib.sha1(origin_of(impl)["spec"].encode()).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', impl.name)}-{digest}"


class PerImplementation(ExampleDatabase):
    """Delegates to ``root/<implementation key>``; with no implementation current, holds nothing."""

    current: str | None = None  # set by the plugin around each kernel property

    def __init__(self, root: Path):
        super().__init__()
        self.root = Path(root)
        self._open: dict[str, DirectoryBasedExampleDatabase] = {}

    @classmethod
    def default(cls) -> "PerImplementation":
        return cls(Path(os.environ.get("FLASHCHECK_DB") or Path.cwd() / ".flashcheck" / "examples").resolve())

    def _db(self):
        key = PerImplementation.current
        if key is None:
            return None
        if key not in self._open:
            self._open[key] = DirectoryBasedExampleDatabase(str(self.root / key))
        return self._open[key]

    def fetch(self, key: bytes):
        db = self._db()
        return iter(()) if db is None else db.fetch(key)

    def save(self, key: bytes, value: bytes) -> None:
        db = self._db()
        if db is not None:
            db.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        db = self._db()
        if db is not None:
            db.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        db = self._db()
        if db is not None:
            db.move(src, dest, value)

    def __repr__(self):
        return f"PerImplementation({str(self.root)!r})"
