"""`cairn cache ls | verify | purge --disk-cache DIR`: look after a disk cache directory offline.

ls      every namespace (one per model and layout) with its segment count and bytes
verify  read every segment of every namespace (or one) and check every checksum; exit 1 if any is bad
purge   delete one namespace's segments (refused while a server holds its lock); foreign files stay
"""

from __future__ import annotations

import argparse
import sys

from cairn.cache.disk_namespace import DiskStoreError, list_namespaces, purge_namespace, verify_store


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("ls", "verify", "purge"), help="what to do")
    p.add_argument("--disk-cache", required=True, help="the disk cache directory (as given to cairn serve)")
    p.add_argument("--namespace", default=None, help="a namespace digest (purge needs one; verify: all by default)")


def run(ns: argparse.Namespace) -> int:
    try:
        if ns.action == "ls":
            return _ls(ns.disk_cache)
        if ns.action == "verify":
            return _verify(ns.disk_cache, ns.namespace)
        return _purge(ns.disk_cache, ns.namespace)
    except (DiskStoreError, OSError) as e:
        print(f"cairn cache {ns.action}: {e}", file=sys.stderr)
        return 1


def _ls(root: str) -> int:
    rows = list_namespaces(root)
    print(f"{'namespace':<64}  {'segments':>8}  {'MiB':>10}")
    for row in rows:
        print(f"{row.digest:<64}  {row.num_segments:>8}  {row.size_bytes / 2**20:>10.2f}")
    print(f"{len(rows)} namespace(s), {sum(r.size_bytes for r in rows) / 2**20:.2f} MiB")
    return 0


def _verify(root: str, namespace: str | None) -> int:
    bad_total = 0
    for digest, result in verify_store(root, namespace).items():
        print(f"{digest}: {result.ok} ok, {len(result.bad)} bad")
        for name, reason in result.bad:
            print(f"  {name}: {reason}")
        bad_total += len(result.bad)
    return 1 if bad_total else 0


def _purge(root: str, namespace: str | None) -> int:
    if not namespace:
        print("cairn cache purge: give --namespace (see cairn cache ls)", file=sys.stderr)
        return 2
    removed = purge_namespace(root, namespace)
    print(f"removed {removed} segment file(s) of {namespace}")
    return 0
