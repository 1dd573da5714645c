"""Load a Hugging Face checkpoint directory unchanged: config.json and safetensors (sharded or not).

The model is built on the meta device, materialised empty on the target device, then filled tensor
by tensor straight from the safetensors files (no second copy of the weights in memory). Vision tower
(`model.visual.*`) and multi-token-prediction (`mtp.*`) tensors are skipped and the log says how many.
A tensor that belongs nowhere, or a parameter left incomplete, is an error naming it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from cairn.model.config import ModelConfig
from cairn.model.families import config_from_hf, model_class
from cairn.model.hybrid import HybridModel, WeightError
from cairn.ops import select_kernels

log = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def read_config(path: Path) -> tuple[ModelConfig, dict]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json (is this a Hugging Face checkpoint directory?)")
    raw = json.loads(cfg_file.read_text())
    return config_from_hf(raw), raw


def resolve_dtype(name: str, raw_config: dict) -> torch.dtype:
    """The dtype for `--dtype name`; `auto` takes the checkpoint's (text_config first), else float32."""
    if name != "auto":
        return DTYPES[name]
    text = raw_config.get("text_config") or {}
    declared = text.get("dtype") or text.get("torch_dtype") or raw_config.get("dtype") or raw_config.get("torch_dtype")
    return DTYPES.get(str(declared), torch.float32)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: shards named in the index are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


@contextlib.contextmanager
def _no_parameter_init() -> Iterator[None]:
    """torch.nn.init's functions as no-ops while the model's modules are built on the meta device, where they
    compute nothing anyway: the first normal_ on a meta tensor imports torch._dynamo, about 2 s of every
    process's start-up (a server, a CLI call). Start-up only: the functions are module globals."""
    init = torch.nn.init
    saved = {name: getattr(init, name) for name in dir(init) if name.endswith("_") and not name.startswith("_")}
    for name in saved:
        setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> HybridModel:
    """An uninitialised model of cfg's family on `device` (fill it with load_checkpoint or init)."""
    cls = model_class(cfg)
    with torch.device("meta"), _no_parameter_init():
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(cfg, select_kernels(device))
        finally:
            torch.set_default_dtype(prev)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


def load_checkpoint(path: str | Path, dtype_name: str = "auto", device: str | torch.device = "cpu",
                    show_progress: bool = True) -> tuple[HybridModel, ModelConfig]:
    path = Path(path)
    cfg, raw = read_config(path)
    dtype = resolve_dtype(dtype_name, raw)
    device = torch.device(device)
    model = build_model(cfg, dtype, device)
    files = safetensors_files(path)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    names = [(h, k) for h in handles for k in h.keys()]  # noqa: SIM118 (safe_open is not a mapping)
    skipped = 0
    for handle, name in tqdm(names, desc="loading weights", unit="tensor", disable=not show_progress):
        if name.startswith(SKIPPED_PREFIXES):
            skipped += 1
            continue
        tensor = handle.get_tensor(name).to(device=device, dtype=dtype)
        if not model.load_tensor(name, tensor):
            raise WeightError(f"{path}: tensor {name!r} has no place in the {cfg.family} model")
    model.finish_loading()
    if skipped:
        log.info("skipped %d vision-tower / multi-token-prediction tensors (model.visual.*, mtp.*)", skipped)
    log.info("loaded %s (%s, %d layers, %s) from %s", cfg.family, dtype, cfg.num_layers, device, path)
    return model, cfg
