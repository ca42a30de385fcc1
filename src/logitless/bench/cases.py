"""Benchmark shapes and realistic inputs.

A *case* is one head shape (``N`` tokens, hidden size ``H``, vocabulary ``V``). Its inputs look
like a trained model's: the hidden state of each token points at a few candidate vocabulary rows
with decaying weights, plus isotropic noise, and one scalar is calibrated so that the mean
entropy of the head's softmax is about ``target_entropy`` nats (trained LLMs sit around
1-3 nats on their own samples; random ``hidden``/``weight`` would give ~``log V`` ≈ 12 nats,
where every implementation's softmax is easier and the numbers flatter than real ones).
Targets are *sampled* from that softmax (Gumbel-max over the full vocabulary), as completion
tokens of an RL rollout are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Output heads of the models the issue names: (H, V).
MODELS: dict[str, tuple[int, int]] = {
    "qwen2.5-7b": (3584, 151936),
    "llama3-8b": (4096, 128256),
    "gemma2-2b": (2304, 256000),
}
FULL_TOKENS = (4096, 8192, 32768, 131072)
DEFAULT_TOKENS = (8192, 32768)
# Tiny shapes for CPU runs (CI): still odd-sized, still several sequences.
CPU_MODELS: dict[str, tuple[int, int]] = {"tiny-a": (64, 1000), "tiny-b": (96, 1531)}
CPU_TOKENS = (128, 256)
QUICK_CPU = ("128:tiny-a", "256:tiny-a")

SEQ_LEN = 1024  # completion length T of a row of the batch (N // 4 for tiny N); N = B * T
_CANDIDATES = 8  # vocabulary rows each hidden state leans towards
_GEN_CHUNK = 2048  # tokens per chunk when generating (bounds the fp32 logits of the sampler)


@dataclass(frozen=True)
class Case:
    """One benchmark shape: ``N = B * T`` tokens, head ``[V, H]``."""

    model: str
    n_tokens: int
    hidden_size: int
    vocab_size: int

    @property
    def seq_len(self) -> int:
        return min(SEQ_LEN, max(1, self.n_tokens // 4))

    @property
    def batch(self) -> int:
        return self.n_tokens // self.seq_len

    @property
    def label(self) -> str:
        return f"{self.model} N={_short(self.n_tokens)}"

    def flops(self, objective: str) -> float:
        """GEMM FLOPs of the head: ``2NHV`` rollout, ``6NHV`` forward + backward (``grpo``,
        ``ce``, ``dpo``, ``kto``, ``simpo``: reference log-probs precomputed), ``8NHV`` distillation (``distill``,
        ``jsd``: the teacher's logits GEMM too)."""
        per = {"rollout": 2.0, "distill": 8.0, "jsd": 8.0}.get(objective, 6.0)
        return per * self.n_tokens * self.hidden_size * self.vocab_size


def _short(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def parse_tokens(text: str) -> int:
    """``"8k"`` → 8192, ``"4096"`` → 4096."""
    t = text.strip().lower()
    n = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    if n <= 0:
        raise ValueError(f"token count must be > 0, got {text!r}")
    return n


def parse_shape(text: str) -> Case:
    """One shape: ``N:model`` (a name of :data:`MODELS` / :data:`CPU_MODELS`) or ``N:HxV``.

    Raises:
        ValueError: malformed text, unknown model, or ``N`` not a multiple of the sequence length.
    """
    try:
        n_text, model = text.split(":")
    except ValueError:
        raise ValueError(f"shape must be 'N:model' or 'N:HxV', got {text!r}") from None
    n = parse_tokens(n_text)
    if model in MODELS or model in CPU_MODELS:
        h, v = {**MODELS, **CPU_MODELS}[model]
    elif "x" in model:
        h, v = (int(x) for x in model.split("x"))
        model = f"H{h}-V{v}"
    else:
        raise ValueError(f"unknown model {model!r} in shape {text!r}; known: {sorted({**MODELS, **CPU_MODELS})} "
                         "or HxV")
    case = Case(model, n, h, v)
    if n % case.seq_len:
        raise ValueError(f"N={n} must be a multiple of the sequence length {case.seq_len}")
    return case


def grid(models: list[str], tokens: list[int]) -> list[Case]:
    """Every ``(N, model)`` pair, smallest ``N`` first (a time budget then drops the largest)."""
    return [parse_shape(f"{n}:{m}") for n in sorted(tokens) for m in models]


@dataclass
class Inputs:
    """Everything every row of a case reads; all on the benchmark device.

    Attributes:
        hidden: ``[B, T, H]`` leaf (``requires_grad``), ``dtype``.
        weight: ``[V, H]`` leaf (``requires_grad``), ``dtype``.
        targets: ``[B, T]`` int64 completion tokens, sampled from the head's softmax.
        mask: ``[B, T]`` completion mask (all ones: every token counts, so FLOPs are exact).
        advantages: ``[B]`` per-sequence advantages, ``N(1, 0.5)``: mostly positive, so the loss
            (about ``-mean A``) is far from 0 and its relative difference between
            implementations means something; tokens are still clipped on both sides.
        old_logp, ref_logp: ``[B, T]`` fp32 log-probs of the old policy and the reference
            (the sampled tokens' true log-probs plus small noise: ratios near 1, some clipped).
        true_entropy: mean entropy (nats) of the generated head, fp32, measured while sampling.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    true_entropy: float

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.weight, self.targets, self.mask,
                                                             self.advantages, self.old_logp, self.ref_logp))


def _signal(weight32: torch.Tensor, cand: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``Σ_k coef_k W[cand_k]`` → ``[n, H]`` fp32."""
    return torch.einsum("nk,nkh->nh", coef, weight32[cand])


def _entropy(z: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def make_inputs(case: Case, device: torch.device, dtype: torch.dtype, *, target_entropy: float = 2.0,
                seed: int = 0) -> Inputs:
    """Realistic inputs for ``case`` (see the module docstring), reproducible from ``seed``."""
    n, h, v = case.n_tokens, case.hidden_size, case.vocab_size
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device, dtype=torch.float32)

    weight32 = randn(v, h) / math.sqrt(h)  # rows of norm ~1
    weight = weight32.to(dtype)
    weight32 = weight.float()
    cand = torch.randint(0, v, (n, _CANDIDATES), generator=gen, device=device)
    decay = 0.3 + 1.2 * rand(n, 1)  # per-token sharpness
    coef = torch.exp(-decay * torch.arange(_CANDIDATES, device=device, dtype=torch.float32))
    noise = randn(n, h) / math.sqrt(h)

    # Calibrate the scale s of hidden = s * signal + noise on a sample of tokens (entropy falls with s).
    k = min(n, 256)
    sig_k = _signal(weight32, cand[:k], coef[:k])
    z_sig, z_noise = sig_k @ weight32.t(), noise[:k] @ weight32.t()  # logits are linear in s
    lo, hi = 0.0, 200.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if float(_entropy(mid * z_sig + z_noise).mean()) > target_entropy:
            lo = mid
        else:
            hi = mid
    scale = (lo + hi) / 2

    hidden = torch.empty(n, h, device=device, dtype=dtype)
    targets = torch.empty(n, device=device, dtype=torch.long)
    logp = torch.empty(n, device=device, dtype=torch.float32)
    ent_sum = 0.0
    for s in range(0, n, _GEN_CHUNK):
        e = min(s + _GEN_CHUNK, n)
        hidden[s:e] = (scale * _signal(weight32, cand[s:e], coef[s:e]) + noise[s:e]).to(dtype)
        # bf16 GEMM on GPUs (fast), fp32 on CPUs (bf16 matmuls are slow there)
        z = (hidden[s:e] @ weight.t()).float() if device.type == "cuda" else hidden[s:e].float() @ weight32.t()
        gumbel = -torch.log(-torch.log(rand(e - s, v).clamp_(min=1e-20)))
        targets[s:e] = (z + gumbel).argmax(-1)
        del gumbel
        lsm = torch.log_softmax(z, dim=-1)
        logp[s:e] = lsm.gather(1, targets[s:e, None]).squeeze(1)
        ent_sum += float(-(lsm.exp() * lsm).sum())
        del z, lsm
    b, t = case.batch, case.seq_len
    old_logp = (logp + 0.05 * randn(n)).clamp(max=0.0)
    ref_logp = (logp + 0.1 * randn(n)).clamp(max=0.0)
    return Inputs(
        hidden=hidden.reshape(b, t, h).requires_grad_(True),
        weight=weight.requires_grad_(True),
        targets=targets.reshape(b, t),
        mask=torch.ones(b, t, device=device, dtype=torch.int64),
        advantages=1.0 + 0.5 * randn(b),
        old_logp=old_logp.reshape(b, t),
        ref_logp=ref_logp.reshape(b, t),
        true_entropy=ent_sum / n,
    )
