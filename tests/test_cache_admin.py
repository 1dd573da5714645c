"""`cairn cache ls | verify | purge`: what the command refuses and what it prints, in-process through
`cairn.cli.main` on a real disk cache directory (the happy path over a server's files: test_cli.py).

A purge needs a namespace and never touches one a running store holds; a namespace id matching several
namespaces is refused; a directory without namespaces verifies and lists as empty.
"""

from __future__ import annotations

import os
import unicodedata

from cairn.cache.disk.store import DiskStore
from cairn.cache.segments.segment import Segment, segment_key
from cairn.cli import main

DIGEST = "ab" * 32
SIBLING = "ab" * 8 + "cd" * 24  # shares its first 16 characters (the short id) with DIGEST


def segment(i: int) -> Segment:
    tokens = [i, i + 1, i + 2]
    return Segment(segment_key(None, tokens), None, 0, tokens, bytes([i]) * 100, {"i": i})


def filled(root, digest: str, num_segments: int = 2) -> None:
    with DiskStore(root, digest, 1 << 20) as store:
        for i in range(num_segments):
            assert store.put(segment(i + 1))


def cache_command(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["cache", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_purge_without_a_namespace_is_refused_and_deletes_nothing(tmp_path, capsys):
    filled(tmp_path, DIGEST)
    status, _, err = cache_command(capsys, "purge", "--disk-cache", str(tmp_path))
    assert status == 2 and "give --namespace" in err
    assert len([n for n in os.listdir(tmp_path / DIGEST) if n.endswith(".seg")]) == 2


def test_purge_of_a_namespace_a_running_store_holds_is_refused_and_deletes_nothing(tmp_path, capsys):
    filled(tmp_path, DIGEST)
    with DiskStore(tmp_path, DIGEST, 1 << 20) as live:  # a server using it holds its lock
        status, _, err = cache_command(capsys, "purge", "--disk-cache", str(tmp_path), "--namespace", DIGEST[:16])
        assert status == 1 and "in use by another process" in err
        assert len(live) == 2 and all(live.get(k) is not None for k in live.keys())  # noqa: SIM118 (a store)
    status, out, _ = cache_command(capsys, "purge", "--disk-cache", str(tmp_path), "--namespace", DIGEST[:16])
    assert status == 0 and out.strip() == f"removed 2 segment file(s) of {DIGEST[:16]}"
    assert not (tmp_path / DIGEST).exists()  # nothing of anyone else's was in it


def test_purge_by_a_prefix_shorter_than_the_short_id_is_refused_and_deletes_nothing(tmp_path, capsys):
    """`--namespace 4` matched one namespace by its first character and purged it: a typo away from deleting
    another model's cache. purge (only) needs the whole short id `ls` prints, or more."""
    filled(tmp_path, DIGEST)
    status, _, err = cache_command(capsys, "purge", "--disk-cache", str(tmp_path), "--namespace", DIGEST[:4])
    assert status == 2 and "needs the whole id" in err
    assert len([n for n in os.listdir(tmp_path / DIGEST) if n.endswith(".seg")]) == 2
    status, _, _ = cache_command(capsys, "verify", "--disk-cache", str(tmp_path), "--namespace", DIGEST[:4])
    assert status == 0  # reading keeps any unambiguous prefix


def test_a_namespace_id_matching_two_namespaces_is_refused(tmp_path, capsys):
    filled(tmp_path, DIGEST)
    filled(tmp_path, SIBLING, 1)
    status, _, err = cache_command(capsys, "verify", "--disk-cache", str(tmp_path), "--namespace", DIGEST[:16])
    assert status == 1 and "matches 2 namespaces" in err
    status, out, _ = cache_command(capsys, "verify", "--disk-cache", str(tmp_path), "--namespace", DIGEST[:17])
    assert status == 0 and out.strip() == f"{DIGEST[:16]}: 2 ok, 0 bad"


def test_a_directory_without_namespaces_verifies_and_lists_as_empty(tmp_path, capsys):
    (tmp_path / "not-a-namespace").mkdir()
    status, out, _ = cache_command(capsys, "verify", "--disk-cache", str(tmp_path))
    assert status == 0 and out.strip() == f"no disk cache namespace in {tmp_path}"
    status, out, _ = cache_command(capsys, "ls", "--disk-cache", str(tmp_path))
    assert status == 0 and out.splitlines()[-1] == "0 namespace(s), 0.00 MiB"


def test_a_namespace_id_matching_none_and_a_path_that_is_not_a_directory_are_refused_in_one_line(tmp_path, capsys):
    filled(tmp_path, DIGEST)
    status, _, err = cache_command(capsys, "purge", "--disk-cache", str(tmp_path), "--namespace", "f" * 16)
    assert status == 1 and f"no namespace '{'f' * 16}' in {tmp_path} (see cairn cache ls)" in err
    assert len(os.listdir(tmp_path / DIGEST)) >= 2  # nothing purged
    a_file = tmp_path / "cache.txt"
    a_file.write_text("")
    status, _, err = cache_command(capsys, "ls", "--disk-cache", str(a_file))
    assert status == 1 and f"{a_file} is not a directory" in err and len(err.strip().splitlines()) == 1


def columns(text: str) -> int:
    """Terminal columns `text` takes: East Asian wide characters 2, combining marks 0."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1
               for c in text)


def test_ls_escapes_control_characters_in_model_names_and_keeps_the_table_aligned(tmp_path, capsys):
    """A .model file holds anyone's bytes (up to 4 KB are read): no newline, control byte or terminal escape
    of it reaches the terminal, and a name of any length takes the model column's 32 columns exactly."""
    models = {"11" * 32: b"Qwen/Qwen3.5-0.8B",
              "22" * 32: b"\x1b]0;owned\x07\x1b[2J\r\nfake row\n" + bytes(range(256)) * 15,
              "33" * 32: b"/models/" + b"a-very-long-local-checkpoint-directory-name",
              "44" * 32: "\u6a21\u578b/\u0305\u202e".encode() * 12 + b"\xff\xfe"}
    for digest, model in models.items():
        filled(tmp_path, digest, 1)
        (tmp_path / digest / ".model").write_bytes(model)
    status, out, _ = cache_command(capsys, "ls", "--disk-cache", str(tmp_path))
    lines = out.splitlines()
    assert status == 0 and len(lines) == 1 + len(models) + 1  # the header, a row each, the total
    assert all(c.isprintable() for c in out.replace("\n", ""))
    header, *rows, _ = lines
    assert rows[0].startswith("1111111111111111  Qwen/Qwen3.5-0.8B  ")
    assert rows[1].startswith(r"2222222222222222  \x1b]0;owned\x07\x1b[2J\r\nfa...  ")
    assert rows[2].startswith("3333333333333333  /models/a-very-long-local-che...  ")
    size = os.path.getsize(next((tmp_path / ("11" * 32)).glob("*.seg")))
    for row in rows:
        assert columns(row) == columns(header) == 16 + 2 + 32 + 2 + 8 + 2 + 10, row
        assert row.endswith(f"  {1:>8}  {size / 2**20:>10.2f}"), row
