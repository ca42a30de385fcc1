"""The reference model as the cache sees it: final hidden states plus the output head.

Log-probs are computed by :func:`logitless.token_logprobs` on the backbone's final hidden
states, so the ``[B, T, V]`` logits are never formed. For a Hugging Face causal LM the
backbone is ``model.base_model`` (e.g. ``Qwen2ForCausalLM.model``, which applies the final
norm) and the head is ``model.get_output_embeddings()`` (the tied input embedding where
tied), with its bias and the config's ``logit_scale``/``final_logit_softcapping``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import __version__
from ..objectives import token_logprobs
from ..ops import Head, LogitTransform, PassOptions
from .fingerprint import Fingerprint, HashMode, dtype_name, tokenizer_fingerprint, weights_fingerprint

HiddenFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ReferenceModel:
    """Anything that maps token ids to final hidden states, plus a linear head.

    Attributes:
        hidden_fn: ``(input_ids [B, T] int64, attention_mask [B, T] int64) -> hidden [B, T, H]``,
            the final (normed) hidden states the head is applied to; sequences are right-padded.
        weight: ``[V, H]`` head weight.
        bias: ``[V]`` head bias or ``None``.
        logit_scale: multiplier before soft-capping (see ``LogitTransform``).
        softcap: final-logit soft-capping or ``None``.
        module: the ``nn.Module`` whose ``state_dict()`` is fingerprinted (required unless
            ``weights_fingerprint`` is given).
        weights_fingerprint: a precomputed weights fingerprint, used instead of hashing ``module``.
    """

    hidden_fn: HiddenFn
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    logit_scale: float = 1.0
    softcap: float | None = None
    module: nn.Module | None = None
    weights_fingerprint: str | None = None

    @classmethod
    def from_hf(cls, model: nn.Module) -> ReferenceModel:
        """Wrap a Hugging Face causal LM (PEFT-wrapped ones included).

        Raises:
            UnsupportedModelError: see ``logitless.model_heads.find_head``/``backbone``; an
                active LoRA adapter on the head (merge it first).
        """
        from ..model_heads import UnsupportedModelError, backbone, find_head

        head = find_head(model)
        if head.lora is not None:
            raise UnsupportedModelError(f"{type(model).__name__} has an active LoRA adapter on its head; merge it "
                                        "(peft merge_and_unload) before caching reference log-probs")
        bb = backbone(model)

        def hidden_fn(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return bb(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

        return cls(hidden_fn=hidden_fn, weight=head.weight, bias=head.bias, logit_scale=head.transform.logit_scale,
                   softcap=head.transform.softcap, module=model)

    def fingerprint(self, *, tokenizer: object | None = None, temperature: float = 1.0,
                    mode: HashMode = "auto") -> Fingerprint:
        """The :class:`Fingerprint` of values this model produces at ``temperature``.

        Raises:
            ValueError: neither ``module`` nor ``weights_fingerprint`` is set, or the module was freed.
        """
        if self.weights_fingerprint is not None:
            digest, used = self.weights_fingerprint, "given"
        elif self.module is not None:
            digest, used = weights_fingerprint(self.module, mode)
        else:
            raise ValueError("ReferenceModel needs `module` or `weights_fingerprint` to be fingerprinted")
        return Fingerprint(
            model_weights=digest, weights_hash_mode=used,
            model_class=type(self.module).__name__ if self.module is not None else "callable",
            vocab_size=int(self.weight.shape[0]), hidden_size=int(self.weight.shape[1]),
            tokenizer=None if tokenizer is None else tokenizer_fingerprint(tokenizer),
            dtype=dtype_name(self.weight.dtype), temperature=float(temperature),
            logit_scale=float(self.logit_scale), softcap=None if self.softcap is None else float(self.softcap),
            library_version=__version__)

    @property
    def device(self) -> torch.device:
        return self.weight.device


def as_reference(model: nn.Module | ReferenceModel) -> ReferenceModel:
    """``model`` itself if it is a :class:`ReferenceModel`, else ``ReferenceModel.from_hf(model)``.

    Raises:
        TypeError: neither a ``ReferenceModel`` nor an ``nn.Module``.
    """
    if isinstance(model, ReferenceModel):
        return model
    if isinstance(model, nn.Module):
        return ReferenceModel.from_hf(model)
    raise TypeError(f"expected a Hugging Face causal LM or a ReferenceModel, got {type(model).__name__}")


@torch.inference_mode()
def batch_logprobs(
    ref: ReferenceModel,
    input_ids: torch.Tensor,  # [B, T] int64, right-padded
    lengths: torch.Tensor,  # [B] int64
    compute: torch.Tensor,  # [B, T] bool: positions whose log-prob is wanted
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs of a right-padded batch, aligned with the tokens.

    ``out[b, t] = log p(x[b, t] | x[b, :t])`` (nats) for ``1 <= t < lengths[b]`` where
    ``compute[b, t]``, from the hidden state at ``t - 1``; ``NaN`` elsewhere (position 0 has
    no prefix). Entropy (optional) is that of the same predictive distribution.

    Returns:
        ``(logp [B, T], entropy [B, T] or None)`` on the model's device, fp32 (fp64 for fp64 models).
    """
    dev = ref.device
    input_ids, lengths, compute = input_ids.to(dev), lengths.to(dev), compute.to(dev)
    B, T = input_ids.shape
    attn = (torch.arange(T, device=dev)[None, :] < lengths[:, None]).long()
    hidden = ref.hidden_fn(input_ids, attn)  # [B, T, H]
    hidden = hidden.to(ref.weight.dtype)
    want = compute[:, 1:] & attn[:, 1:].bool()  # [B, T-1]: target t+1 predicted from hidden t
    targets = input_ids[:, 1:].masked_fill(~want, -100)
    head = Head(ref.weight, ref.bias, LogitTransform(temperature, ref.logit_scale, ref.softcap))
    res = token_logprobs(hidden[:, :-1], head, targets, entropy=entropy,
                         options=PassOptions(chunk_bytes=chunk_bytes))
    logp, ent = res if entropy else (res, None)

    def place(x: torch.Tensor) -> torch.Tensor:
        out = torch.full((B, T), float("nan"), dtype=x.dtype, device=dev)
        out[:, 1:] = x.masked_fill(~want, float("nan"))
        return out

    return place(logp), None if ent is None else place(ent)


def free_reference(model: nn.Module | ReferenceModel) -> None:
    """Release a reference model's memory once its log-probs are cached.

    Moves every parameter and buffer to the ``meta`` device (the module keeps its structure
    and shapes) and empties the original tensors in place, so storage is freed even where
    other objects still hold the parameters (optimizers, a :class:`ReferenceModel`); then runs
    ``gc.collect()`` and ``torch.cuda.empty_cache()``. The model cannot be run afterwards;
    drop your own references to it as well.
    """
    module = model.module if isinstance(model, ReferenceModel) else model
    if isinstance(model, ReferenceModel):
        olds = [t for t in (model.weight, model.bias) if t is not None]
        model.hidden_fn = _freed  # type: ignore[assignment]
    else:
        olds = []
    if module is not None:
        olds += list(module.parameters()) + list(module.buffers())
        with torch.no_grad():
            module.to("meta")
    with torch.no_grad():
        for t in olds:
            if not t.is_meta:
                t.grad = None
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _freed(*_args: object) -> torch.Tensor:
    raise RuntimeError("this reference model was released by free_reference()")
