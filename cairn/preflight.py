"""Checks of what a user typed, run by the command line before anything slow (torch, weights, pools).

Each check raises `UserError` with one line that says what is wrong and what to do; `cairn.cli`
prints that line and exits with status 2, without a traceback. What is checked:

    check_model(path)       the --model directory exists, is not a hub id, has config.json that
                            cairn implements (no unsupported key, no quantization_config), weights
                            and tokenizer.json
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
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as on huggingface.co


class UserError(Exception):
    """A mistake in what the user asked for; its message is one line saying what to do."""


def check_model(model: str | None) -> None:
    """The --model directory is a checkpoint cairn can load (None, the demo model, always is)."""
    if model is None:
        return
    path = Path(model)
    if not path.exists():
        if HUB_ID.match(model):
            local = f"~/models/{model.split('/')[-1]}"
            raise UserError(f"--model {model}: no such directory; it looks like a Hugging Face hub id, and cairn "
                            f"loads a local checkpoint directory: download it first (e.g. `huggingface-cli download "
                            f"{model} --local-dir {local}`), then pass --model {local}")
        raise UserError(f"--model {model}: no such directory (pass a Hugging Face checkpoint directory)")
    if not path.is_dir():
        raise UserError(f"--model {model}: not a directory (pass the checkpoint's directory, not a file in it)")
    if not (path / "config.json").is_file():
        raise UserError(f"--model {model}: no config.json (is this a Hugging Face checkpoint directory?)")
    raw = _read_config(path)
    if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("*.safetensors")):
        raise UserError(f"--model {model}: no *.safetensors weights in the directory (is the download complete?)")
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"--model {model}: no tokenizer.json in the directory (is the download complete?)")
    _check_config(path, raw)  # last: the model families import torch (seconds before the line above would show)


def _read_config(path: Path) -> dict:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--model {path}: config.json cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"--model {path}: config.json is not a JSON object")
    return raw


def _check_config(path: Path, raw: dict) -> None:
    from cairn.model.config import ConfigError
    from cairn.model.families import config_from_hf

    try:
        config_from_hf(raw)
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
