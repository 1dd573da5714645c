"""Optional kernel libraries, imported when first asked for: the module, or None with one log line.

A library's CUDA extension is built against one torch / CUDA pair and raises at import under any other
(triton, likewise, without a GPU), so every failure to import, not only ImportError, means "absent":
the reference kernels run instead and the log line says which and why.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)


def import_optional(module: str, library: str, fallback: str) -> ModuleType | None:
    """`module` imported, or None after logging "`library` unavailable (why): `fallback`"."""
    try:
        return importlib.import_module(module)
    except Exception as e:
        log.info("%s unavailable (%s): %s", library, e, fallback)
        return None
