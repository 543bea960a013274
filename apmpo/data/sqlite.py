"""Read-only SQLite connections. The schema a SQL prompt shows (apmpo.data) and the queries a SQL reward runs
(apmpo.rewards.sql) open their database the same way: through a `mode=ro` URI with `PRAGMA query_only`, no ATTACH,
and an authorizer that allows reading only (no PRAGMA, writes or schema changes)."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from urllib.parse import quote

# Reading is all a connection may do.
_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


def _authorize(action: int, *_args) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def open_readonly(db_path: str | Path) -> sqlite3.Connection:
    """A connection that can only read `db_path`; raises if the file does not exist."""
    path = Path(db_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"sqlite database not found: {path}")
    conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, check_same_thread=False)
    # Spider's databases hold a few non-UTF-8 strings; the official evaluation decodes them leniently.
    conn.text_factory = lambda b: b.decode(errors="ignore")
    conn.execute("PRAGMA query_only = ON")
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.set_authorizer(_authorize)
    return conn
