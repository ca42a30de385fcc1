"""The one place that decides which backend runs a vocabulary pass."""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Literal

import torch

Impl = Literal["auto", "torch", "triton", "flash"]


def triton_available() -> bool:
    """Whether Triton imports (it runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``)."""
    return importlib.util.find_spec("triton") is not None


def resolve_impl(impl: Impl, device: torch.device) -> ModuleType:
    """Backend module for ``impl`` on ``device``.

    ``"auto"`` picks Triton on CUDA when it imports, the torch backend otherwise. ``"flash"``
    (opt-in) is the Triton backend whose kernels never write logits (:mod:`.flash_backend`).

    Raises:
        ValueError: unknown ``impl``, or ``"triton"``/``"flash"`` requested where it cannot run.
    """
    if impl not in ("auto", "torch", "triton", "flash"):
        raise ValueError(f"impl must be 'auto', 'torch', 'triton' or 'flash', got {impl!r}")
    if impl == "auto":
        impl = "triton" if device.type == "cuda" and triton_available() and _triton_backend_ready() else "torch"
    if impl == "torch":
        from . import torch_backend

        return torch_backend
    if not triton_available():
        raise ValueError(f"impl={impl!r} requested but triton is not installed (pip install 'logitless[triton]')")
    import os

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl={impl!r} needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got device {device}")
    if impl == "flash":
        from . import flash_backend

        return flash_backend
    from . import triton_backend

    return triton_backend


def _triton_backend_ready() -> bool:
    return importlib.util.find_spec(f"{__package__}.triton_backend") is not None
