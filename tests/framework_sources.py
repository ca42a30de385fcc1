"""Load one module file of an installed RL framework (verl, OpenRLHF, AgileRL) as the test
oracle, without running its package's ``__init__``.

These frameworks' package ``__init__`` files import Ray, DeepSpeed, flash-attn or vLLM, none of
which installs on a CPU-only machine in CI time; the files that hold the head's math import only
torch (verl) or torch plus names that the functions under test never call (OpenRLHF). CI installs
the frameworks with ``pip install --no-deps -r requirements-frameworks.txt``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import sys
import types
from collections.abc import Iterator

import pytest

INSTALL_HINT = "pip install --no-deps -r requirements-frameworks.txt"


def module_file(distribution: str, path: str, *, widened: bool = False) -> types.ModuleType:
    """The module at ``path`` (relative to site-packages) of the installed ``distribution``,
    executed under a private name (its relative imports unavailable). ``widened``: a separate
    copy whose ``torch`` is :class:`WidenedTorch`. Skips the test when the distribution is not
    installed."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed ({INSTALL_HINT})")
    name = f"_oracle_{distribution}_" + path.removesuffix(".py").replace("/", "_") + ("_fp64" if widened else "")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, dist.locate_file(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if widened:
        mod.torch = WidenedTorch()
    sys.modules[name] = mod
    return mod


class WidenedTorch(types.ModuleType):
    """``torch`` with ``float32`` read as ``float64``: bound as a loaded module's ``torch``, it runs
    that module's fp32 upcasts in float64, so its formulas can be compared at 1e-10."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, item: str):
        import torch

        return torch.float64 if item == "float32" else getattr(torch, item)


class _Stub(types.ModuleType):
    """A module that is not installed: every name imported from it is a function that raises,
    so code under test that reaches it fails loudly instead of running on a stand-in."""

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)

        def missing(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{item} is not installed here (a stub for the import only)")

        return missing


@contextlib.contextmanager
def package_modules(*names: str, stubs: tuple[str, ...] = ()) -> Iterator[list[types.ModuleType]]:
    """Import the dotted module ``names`` of an installed framework with their parent packages
    registered bare (``__path__`` only, their ``__init__`` not run), so that relative imports
    inside the framework resolve; ``stubs`` are modules imported at a file's top but unused by
    the code under test, bound to :class:`_Stub` modules when not installed. The framework's
    modules and the stubs are removed from ``sys.modules`` on exit. Skips the test when the
    framework is not installed."""
    top = names[0].split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{top} is not installed ({INSTALL_HINT})")
    before = set(sys.modules)
    saved = {k: v for k, v in sys.modules.items() if k == top or k.startswith(top + ".")}
    for k in saved:
        del sys.modules[k]
    root = next(iter(spec.submodule_search_locations))
    try:
        missing = [
            s for s in stubs if s.split(".")[0] not in sys.modules and not importlib.util.find_spec(s.split(".")[0])
        ]
        for s in missing:
            for i in range(1, s.count(".") + 2):
                sys.modules.setdefault(".".join(s.split(".")[:i]), _Stub(".".join(s.split(".")[:i])))
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg not in sys.modules:
                    mod = types.ModuleType(pkg)
                    mod.__path__ = [os.path.join(root, *parts[1:i])]
                    sys.modules[pkg] = mod
        yield [importlib.import_module(name) for name in names]
    finally:
        # Only the framework's own modules and the stubs go: anything else imported meanwhile
        # (torch's compiler, transformers' lazy modules) registers global state on import and
        # must stay imported.
        stubbed = {k for k, v in sys.modules.items() if isinstance(v, _Stub)}
        for k in (set(sys.modules) - before) & (
            {k for k in sys.modules if k == top or k.startswith(top + ".")} | stubbed
        ):
            del sys.modules[k]
        sys.modules.update(saved)
