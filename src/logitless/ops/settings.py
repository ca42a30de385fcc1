"""Environment variables of the vocabulary pass, read once per process.

Every ``LOGITLESS_*`` switch of the pass is parsed here, at first use, into one frozen value;
nothing else in the package reads the environment. A variable set after that has no effect
until :func:`reload` (tests use it). Bad values raise at the first pass, naming the variable.

===============================  =======================================================
``LOGITLESS_CHUNK_BYTES``         workspace budget of a pass in bytes (default 1 GiB)
``LOGITLESS_LOGITS_PRECISION``    ``fp32`` (default) or ``input``: see :class:`PassOptions`
``LOGITLESS_TRITON_AUTOTUNE``     ``1``: benchmark the Triton row kernels' launch configs
``LOGITLESS_FLASH_AUTOTUNE``      ``1``: benchmark the flash kernels' tile shapes
``LOGITLESS_FLASH_FILTER``        ``1``: the flash backward skips negligible tiles (approximate)
===============================  =======================================================
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Literal

LogitsPrecision = Literal["fp32", "input"]
DEFAULT_CHUNK_BYTES = 2**30


@dataclass(frozen=True)
class Settings:
    """The parsed environment (see the module docstring)."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    logits_precision: LogitsPrecision = "fp32"
    triton_autotune: bool = False
    flash_autotune: bool = False
    flash_filter: bool = False


def _flag(name: str) -> bool:
    value = os.environ.get(name, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be '0' or '1', got {value!r}")
    return value == "1"


@functools.cache
def settings() -> Settings:
    """The process's :class:`Settings`, parsed on first call.

    Raises:
        ValueError: a variable with a value outside its choices (named in the message).
    """
    chunk = os.environ.get("LOGITLESS_CHUNK_BYTES")
    try:
        chunk_bytes = DEFAULT_CHUNK_BYTES if not chunk else int(chunk)
    except ValueError:
        raise ValueError(f"LOGITLESS_CHUNK_BYTES must be an integer number of bytes, got {chunk!r}") from None
    if chunk_bytes <= 0:
        raise ValueError(f"LOGITLESS_CHUNK_BYTES must be > 0, got {chunk!r}")
    precision = os.environ.get("LOGITLESS_LOGITS_PRECISION", "fp32")
    if precision not in ("fp32", "input"):
        raise ValueError(f"LOGITLESS_LOGITS_PRECISION must be 'fp32' or 'input', got {precision!r}")
    return Settings(chunk_bytes=chunk_bytes, logits_precision=precision,  # type: ignore[arg-type]
                    triton_autotune=_flag("LOGITLESS_TRITON_AUTOTUNE"),
                    flash_autotune=_flag("LOGITLESS_FLASH_AUTOTUNE"), flash_filter=_flag("LOGITLESS_FLASH_FILTER"))


def reload() -> Settings:
    """Parse the environment again (after a test changed it) and drop what was built from the
    old values (kernel configs, autotuned kernels)."""
    settings.cache_clear()
    for clear in _dependents:
        clear()
    return settings()


_dependents: list = []


def on_reload(clear) -> None:
    """Register ``clear()`` to run when :func:`reload` re-reads the environment."""
    _dependents.append(clear)
