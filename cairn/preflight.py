"""Checks of what a user typed, run by the command line before anything slow (torch, weights, pools).

Each check raises `UserError` with one line that says what is wrong and what to do; `cairn.cli`
prints that line and exits with status 2, without a traceback. What is checked:

    check_model(path)       the --model directory exists, is not a hub id, has config.json that
                            cairn implements (no unsupported key, no quantization_config), weights
                            (every shard its index names, each file as long as its header says: an
                            interrupted download or a Git LFS pointer is refused here) and tokenizer.json
                            (with tokenizer_config.json, whole JSON);
                            and --quantization is implemented for the model (int8 is not on MoE)
    check_port(host, port)  the server's address can be bound now (not after the model has loaded)

What this is not: the loader (cairn.model.loader), which still validates everything it reads. This
module imports neither torch nor the server; the last check of a --model directory, its config against
the model families, imports torch (seconds), so every file check comes before it.
"""

from __future__ import annotations

import errno
import json
import re
import socket
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from cairn.config import DEMO_NAME, is_random_demo
from cairn.model.demo_checkpoint import demo_checkpoint

if TYPE_CHECKING:
    from cairn.model.config import ModelConfig

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as on huggingface.co
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit on a file's JSON header
LFS_POINTER = b"version https://git-lfs"  # what `git clone` without git-lfs leaves instead of the weights


class UserError(Exception):
    """A mistake in what the user asked for; its message is one line saying what to do."""


def check_model(model: str | None, quantization: str = "none") -> None:
    """The --model directory is a checkpoint cairn can load (None and the random demo model always are; the
    trained demo model's files must match their checksums: it is known to load, and its check imports no torch),
    and `--quantization` is implemented for it (a QuantizationError, one line, before the weights load)."""
    if is_random_demo(model):
        return
    if model == DEMO_NAME:  # shipped with cairn and known to load: its files need only be the ones shipped
        demo_checkpoint()
        return
    path = Path(model)
    if not path.exists():
        if HUB_ID.match(model):
            local = f"~/models/{model.split('/')[-1]}"
            raise UserError(f"--model {model}: no such directory; it looks like a Hugging Face hub id, and cairn "
                            f"loads a local checkpoint directory: download it first (e.g. `hf download "
                            f"{model} --local-dir {local}`), then pass --model {local}")
        raise UserError(f"--model {model}: no such directory (pass a Hugging Face checkpoint directory)")
    if not path.is_dir():
        raise UserError(f"--model {model}: not a directory (pass the checkpoint's directory, not a file in it)")
    if not (path / "config.json").is_file():
        raise UserError(f"--model {model}: no config.json (is this a Hugging Face checkpoint directory?)")
    raw = _read_config(path)
    _check_weights(path)
    _check_tokenizer(path)
    # last: the model families import torch (seconds before the lines above would show)
    cfg = _check_config(path, raw)
    from cairn.model.layout import check_quantization

    check_quantization(cfg, quantization)


def _read_config(path: Path) -> dict:
    return _read_json_object(path, "config.json")


def _read_json_object(path: Path, name: str, hint: str = "") -> dict:
    """The JSON object in the checkpoint's file `name`; a UserError (with `hint` after it) when it is none."""
    try:
        raw = json.loads((path / name).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--model {path}: {name} cannot be read: {e}{hint}") from None
    if not isinstance(raw, dict):
        raise UserError(f"--model {path}: {name} is not a JSON object{hint}")
    return raw


def _check_tokenizer(path: Path) -> None:
    """tokenizer.json (and tokenizer_config.json, where there is one) are whole JSON objects: a file an
    interrupted download cut short would otherwise fail as a traceback once the weights have loaded."""
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"--model {path}: no tokenizer.json in the directory (is the download complete?)")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (path / name).is_file():
            _read_json_object(path, name, " (is the download complete?)")


def _check_weights(path: Path) -> None:
    """The weight files are all there and whole. The loader would find a missing or cut-short shard too,
    but only after torch and the model are up, and as a traceback."""
    index = path / "model.safetensors.index.json"
    files = _indexed_shards(path, index) if index.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"--model {path}: no *.safetensors weights in the directory (is the download complete?)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"--model {path}: {len(missing)} of its {len(files)} weight files are missing "
                        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): is the download complete?")
    for file in files:
        _check_safetensors_whole(file)


def _indexed_shards(path: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({path / name for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"--model {path}: {index.name} cannot be read ({type(e).__name__}: {e})") from None


def _check_safetensors_whole(file: Path) -> None:
    """The file is a safetensors file at least as long as its header's tensors reach (the header is an
    8-byte little-endian length, then JSON giving each tensor's data_offsets in the data that follows)."""
    size = file.stat().st_size
    with file.open("rb") as f:
        start = f.read(len(LFS_POINTER))
        if start == LFS_POINTER:
            raise UserError(f"--model {file.parent}: {file.name} is a Git LFS pointer, not the weights (cloned "
                            "without git-lfs?): run `git lfs pull` in the directory, or download it again")
        header_len = struct.unpack("<Q", start[:8])[0] if len(start) >= 8 else 0
        if not 0 < header_len <= min(MAX_SAFETENSORS_HEADER, size - 8):
            raise UserError(f"--model {file.parent}: {file.name} is not a safetensors file, or is cut short "
                            f"({size} bytes): is the download complete?")
        f.seek(8)
        try:
            header = json.loads(f.read(header_len))
            data_end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise UserError(f"--model {file.parent}: {file.name} has an unreadable safetensors header "
                            f"({type(e).__name__}: {e})") from None
    if size < 8 + header_len + data_end:
        raise UserError(f"--model {file.parent}: {file.name} is cut short ({size} of {8 + header_len + data_end} "
                        "bytes): is the download complete?")


def _check_config(path: Path, raw: dict) -> ModelConfig:
    from cairn.model.config import ConfigError
    from cairn.model.families import config_from_hf

    try:
        return config_from_hf(raw)
    except ConfigError as e:
        quantized = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
        if quantized:
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
            raise UserError(f"--model {path}: the checkpoint is quantized (quantization_config: {method}), which "
                            "cairn does not load: use the unquantized (bf16) checkpoint") from None
        raise UserError(f"--model {path}: {e}") from None


def check_port(host: str, port: int) -> None:
    """`host:port` can be listened on now. Port 0 (any free port) always can."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT socket is no conflict
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is already in use (another server?): stop it or pass "
                                "another --port") from None
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
