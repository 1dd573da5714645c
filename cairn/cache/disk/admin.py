"""`cairn cache ls | verify | purge --disk-cache DIR`: look after a disk cache directory offline.

ls      every namespace (one per model and layout): its short id, model, segment count and size
verify  read every segment of every namespace (or one) and check every checksum; exit 1 if any is bad
purge   delete one namespace's segments (refused while a server holds its lock); foreign files stay

--namespace takes the short id the server's start-up log prints (any unambiguous prefix of the
digest). A directory that does not exist, or an unknown namespace, is a one-line error and exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys

from cairn.cache.disk.namespace import DiskStoreError
from cairn.cache.disk.offline import SHORT_ID_CHARS, list_namespaces, purge_namespace, resolve_namespace, verify_store


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("ls", "verify", "purge"), help="what to do")
    p.add_argument("--disk-cache", required=True, help="the disk cache directory (as given to cairn serve)")
    p.add_argument("--namespace", default=None, help="a namespace id, as `ls` and the server's log print it, or "
                   "the whole digest (purge needs one; verify: all by default)")


def run(ns: argparse.Namespace) -> int:
    try:
        if not os.path.isdir(ns.disk_cache):
            raise DiskStoreError(f"{ns.disk_cache} is not a directory")
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
    print(f"{'namespace':<{SHORT_ID_CHARS}}  {'model':<32}  {'segments':>8}  {'MiB':>10}")
    for row in rows:
        print(f"{row.digest[:SHORT_ID_CHARS]:<{SHORT_ID_CHARS}}  {row.model or '(unknown)':<32}  "
              f"{row.num_segments:>8}  {row.size_bytes / 2**20:>10.2f}")
    print(f"{len(rows)} namespace(s), {sum(r.size_bytes for r in rows) / 2**20:.2f} MiB")
    return 0


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
