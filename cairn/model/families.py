"""The model families cairn serves: `model_type` -> the family file that parses its config and builds its model.

A family file (`cairn/model/<family>.py`) declares

    MODEL_TYPES  the config.json `model_type` values it serves
    parse_config(raw: dict) -> ModelConfig      its KeyTable check and ModelConfig construction
    MODEL_CLASS  its HybridModel subclass (layer composition hooks and checkpoint tensor names)

and is listed once in FAMILY_FILES below; nothing else in cairn names a family (the built-in demo model asks
`family_of` its model_type's; bench/checkpoint.py names only model_types). `cfg.family` is the family file's
module name, which `model_class` maps back. What this is not: the loader (weights) or
the config dataclass (cairn.model.config).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from cairn.model import falcon_h1, granitemoehybrid, nemotron_h, qwen3_5, qwen3_5_moe, qwen3_next
from cairn.model.config import ConfigError, ModelConfig
from cairn.model.hybrid import HybridModel

FAMILY_FILES: tuple[ModuleType, ...] = (qwen3_5, qwen3_5_moe, qwen3_next, nemotron_h, granitemoehybrid, falcon_h1)

_BY_MODEL_TYPE = {t: f for f in FAMILY_FILES for t in f.MODEL_TYPES}
_BY_NAME = {f.__name__.rsplit(".", 1)[-1]: f for f in FAMILY_FILES}


def family_of(model_type: str) -> str:
    """The family (ModelConfig.family: its file's module name) serving a config.json `model_type`; KeyError for
    a model_type no family serves."""
    return _BY_MODEL_TYPE[model_type].__name__.rsplit(".", 1)[-1]


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Parse a checkpoint's config.json dict with its family's parser; ConfigError for an unknown family."""
    family = _BY_MODEL_TYPE.get(raw.get("model_type"))
    if family is None:
        raise ConfigError(f"config.json: model_type {raw.get('model_type')!r} is not supported; cairn serves "
                          f"{sorted(_BY_MODEL_TYPE)}")
    return family.parse_config(raw)


def model_class(cfg: ModelConfig) -> type[HybridModel]:
    """The model class of `cfg.family`."""
    return _BY_NAME[cfg.family].MODEL_CLASS
