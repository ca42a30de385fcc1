"""The elementwise map from the head's matmul output to the logits the objectives see.

``z = softcap(logit_scale * y) / temperature`` with ``y = hidden @ weight.T + bias`` and
``softcap(x) = c * tanh(x / c)``. This is the order Hugging Face models apply scaling and
soft-capping (Gemma 2/3 ``final_logit_softcapping``, Cohere ``logit_scale``) followed by the
sampling temperature TRL divides by (``trl.kernels.chunked_logprob._transform``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch


def _as_float(name: str, value: object) -> float:
    """A number given as a Python/NumPy scalar or a one-element tensor, as a ``float``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool or value.is_meta:
            raise TypeError(f"{name} must be a number (or a one-element real tensor), got a {value.dtype} tensor of "
                            f"shape {tuple(value.shape)} on {value.device}")
        return float(value.detach())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


@dataclass(frozen=True)
class LogitTransform:
    """Scalars applied to the head's matmul output, elementwise.

    Attributes:
        temperature: sampling temperature the logits are divided by (> 0).
        logit_scale: multiplier applied before soft-capping (Cohere ``logit_scale``,
            Granite ``1 / logits_scaling``).
        softcap: soft-capping value ``c`` (Gemma ``final_logit_softcapping``) or ``None``.
        identity: derived: ``z = y`` (temperature and scale 1, no cap), so a backend may skip
            :meth:`apply` and :meth:`grad_to_raw`.

    Each is a Python number, a NumPy scalar or a one-element tensor, stored as a ``float``.

    Raises:
        TypeError: a value that is not a number (a string, a bool, a tensor of several elements).
        ValueError: on a non-positive or non-finite ``temperature``/``softcap`` or a
            non-finite ``logit_scale``.
    """

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    identity: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Stored as Python floats: NumPy scalars and one-element tensors (a temperature read
        # from a config or a schedule) are numbers too; strings and bools are not.
        for name in ("temperature", "logit_scale", "softcap"):
            value = getattr(self, name)
            if value is not None or name != "softcap":
                object.__setattr__(self, name, _as_float(name, value))
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if not math.isfinite(self.logit_scale):
            raise ValueError(f"logit_scale must be finite, got {self.logit_scale!r}")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap must be a finite number > 0 or None, got {self.softcap!r}")
        object.__setattr__(self, "identity",
                           self.temperature == 1.0 and self.logit_scale == 1.0 and self.softcap is None)

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        """Map raw matmul output ``y`` (fp32 or fp64) to logits ``z``."""
        if self.logit_scale != 1.0:
            y = y * self.logit_scale
        if self.softcap is not None:
            y = self.softcap * torch.tanh(y / self.softcap)
        if self.temperature != 1.0:
            y = y / self.temperature
        return y

    def grad_to_raw(self, dz: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Chain rule ``dL/dy = dL/dz * dz/dy``, with ``dz/dy`` recovered from ``z`` itself
        (``tanh = z * temperature / softcap``), so the raw ``y`` need not be kept."""
        factor = self.logit_scale / self.temperature
        if self.softcap is not None:
            t = z * (self.temperature / self.softcap)
            dz = dz * (1.0 - t * t)
        return dz * factor if factor != 1.0 else dz
