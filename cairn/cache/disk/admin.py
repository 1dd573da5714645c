"""`cairn cache ls | verify | purge --disk-cache DIR`: look after a disk cache directory offline.

ls      every namespace (one per model and layout): its short id, model, segment count and size
verify  read every segment of every namespace (or one) and check every checksum; exit 1 if any is bad
purge   delete one namespace's segments (refused while a server holds its lock); foreign files stay

--namespace takes the short id the server's start-up log prints (any unambiguous prefix of the
digest; purge, which deletes, the whole short id or more). A directory that does not exist, or an
unknown namespace, is a one-line error and exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import unicodedata

from cairn.cache.disk.namespace import DiskStoreError
from cairn.cache.disk.offline import SHORT_ID_CHARS, list_namespaces, purge_namespace, resolve_namespace, verify_store

MODEL_COLUMNS = 32  # terminal columns of `ls`'s model column
ELLIPSIS = "..."  # ends a cut model name (ASCII: U+2026 is two columns wide on some terminals)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("ls", "verify", "purge"), help="what to do")
    p.add_argument("--disk-cache", required=True, help="the disk cache directory (as given to cairn serve)")
    p.add_argument("--namespace", default=None, help="a namespace id, as `ls` and the server's log print it, or "
                   "the whole digest (purge needs one; verify: all by default)")


def run(ns: argparse.Namespace) -> int:
    try:
        if not os.path.isdir(ns.disk_cache):
            raise DiskStoreError(f"{ns.disk_cache} is not a directory")
        if ns.action == "purge" and ns.namespace is not None and len(ns.namespace) < SHORT_ID_CHARS:
            print(f"cairn cache purge: --namespace needs the whole id `cairn cache ls` prints ({SHORT_ID_CHARS} "
                  "characters) or the digest: a shorter prefix could delete another namespace than meant",
                  file=sys.stderr)
            return 2
        namespace = resolve_namespace(ns.disk_cache, ns.namespace) if ns.namespace is not None else None
        if ns.action == "ls":
            return _ls(ns.disk_cache)
        if ns.action == "verify":
            return _verify(ns.disk_cache, namespace)
        return _purge(ns.disk_cache, namespace)
    except (DiskStoreError, OSError) as e:
        print(f"cairn cache {ns.action}: {e}", file=sys.stderr)
        return 1


def _ls(root: str) -> int:
    rows = list_namespaces(root)
    print(f"{'namespace':<{SHORT_ID_CHARS}}  {'model':<{MODEL_COLUMNS}}  {'segments':>8}  {'MiB':>10}")
    for row in rows:
        print(f"{row.digest[:SHORT_ID_CHARS]:<{SHORT_ID_CHARS}}  {_cell(row.model or '(unknown)', MODEL_COLUMNS)}  "
              f"{row.num_segments:>8}  {row.size_bytes / 2**20:>10.2f}")
    print(f"{len(rows)} namespace(s), {sum(r.size_bytes for r in rows) / 2**20:.2f} MiB")
    return 0


def _cell(text: str, width: int) -> str:
    r"""`text` as a table cell exactly `width` terminal columns wide. A .model file holds anyone's bytes: each
    unprintable character (newline, terminal escape, bidi control) is shown escaped as repr writes it, so
    none reaches the terminal; a longer text is cut, whole characters and escapes only, and ends in ELLIPSIS.

        _cell("a[2J", 10) == r"a[2J  "        _cell("x" * 40, 8) == "xxxxx..."
    """
    pieces = [(c, _columns(c)) if c.isprintable() else (repr(c)[1:-1], len(repr(c)) - 2) for c in text]
    used = sum(columns for _, columns in pieces)
    if used > width:
        kept, used = [], len(ELLIPSIS)
        for piece, columns in pieces:
            if used + columns > width:
                break
            kept.append((piece, columns))
            used += columns
        pieces = [*kept, (ELLIPSIS, 0)]
    return "".join(piece for piece, _ in pieces) + " " * (width - used)


def _columns(char: str) -> int:
    """Terminal columns of one printable character: 2 for East Asian wide ones, 0 for combining marks."""
    return 0 if unicodedata.combining(char) else 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _verify(root: str, namespace: str | None) -> int:
    results = verify_store(root, namespace)
    if not results:
        print(f"no disk cache namespace in {root}")
    bad_total = 0
    for digest, result in results.items():
        print(f"{digest[:SHORT_ID_CHARS]}: {result.ok} ok, {len(result.bad)} bad")
        for name, reason in result.bad:
            print(f"  {name}: {reason}")
        bad_total += len(result.bad)
    return 1 if bad_total else 0


def _purge(root: str, namespace: str | None) -> int:
    if not namespace:
        print("cairn cache purge: give --namespace (see cairn cache ls)", file=sys.stderr)
        return 2
    removed = purge_namespace(root, namespace)
    print(f"removed {removed} segment file(s) of {namespace[:SHORT_ID_CHARS]}")
    return 0
