"""The demo's two measurements on the real model and the real training batch: one GRPO step
through logitless next to TRL's own path, and the head's peak memory with and without logitless."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

# Run in a fresh process so that the peak is the head's alone: no allocator cache, no model.
# "plain" is what TRL's head does (logits materialized in fp32, log_softmax, gathered logp,
# entropy for its metric); "logitless" is logitless.policy_loss on the same tensors.
_HEAD_MEMORY = r"""
import json, os, sys, threading, time, torch
from logitless import Head, LogitTransform, PolicyConfig, policy_loss
mode, path = sys.argv[1], sys.argv[2]
b = torch.load(path, weights_only=True)
device = b["hidden"].device.type
hid, w = b["hidden"].requires_grad_(), b["weight"].requires_grad_()
ids, mask, adv, temp = b["ids"], b["mask"], b["adv"], float(b["temperature"])
def head_loss(hid, w, ids, mask, adv):
    if mode == "plain":
        logits = (hid @ w.T).float() / temp
        logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
        with torch.no_grad():
            ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        ratio = torch.exp(logp - logp.detach())
        return -(ratio * adv[:, None] * mask).sum() / mask.sum()
    loss, _ = policy_loss(hid, Head(w, transform=LogitTransform(temperature=temp)), ids, mask, adv,
                          config=PolicyConfig(loss_type="dapo"))
    return loss
# Warm up on one token first: lazy imports and first-call set-up are not the head's memory.
head_loss(hid[:1, :1], w, ids[:1, :1], mask[:1, :1], adv[:1]).backward()
hid.grad = w.grad = None
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
# ru_maxrss is the whole process's high-water mark (imports, loading); sample the current RSS.
peak_rss, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak_rss[0] = max(peak_rss[0], rss()); time.sleep(0.0005)
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
else:
    base = rss(); threading.Thread(target=sample, daemon=True).start()
head_loss(hid, w, ids, mask, adv).backward()
if device == "cuda":
    torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
else:
    done.set(); peak = max(peak_rss[0], rss()) - base
print(json.dumps({"peak_bytes": peak}))
"""


def one_step(trainer: Any, batch: list[dict]) -> tuple[dict, dict, torch.Tensor]:
    """Generate and score ``batch`` once, then compute the GRPO loss and its gradient on those
    same inputs through logitless and through TRL's own code. The old-policy log-probs are set
    0.1 nats (random, fixed seed) off the current ones: on-policy, every ratio is 1 and the loss
    is ``-mean(advantage)`` whatever the log-probs, which would compare nothing. When every
    reward of the batch is the same (every advantage 0: loss and gradient 0 on both paths, a
    0/0 comparison), the advantages are set to a fixed non-constant vector instead.

    Returns:
        ``(comparison, inputs, logps)``: loss and gradient norm (all parameters) of each path,
        the relative L2 difference of the gradients and where the advantages came from ("trl"
        or "fixed"); TRL's scored inputs of the batch; the current model's per-token log-probs
        of its completions ``[B, T]`` (float32, temperature-scaled as in training).
    """
    from ..integrations.trl import trl_own_path

    inputs = trainer._generate_and_score_completions(batch)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask,
                                                                   inputs["completion_ids"].size(1))
    noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(1234)).to(current.device)
    inputs = dict(inputs, old_per_token_logps=current.float() + 0.1 * noise)
    source = "trl"
    if not inputs["advantages"].abs().max() > 0:
        adv = inputs["advantages"]
        inputs["advantages"] = torch.linspace(-1.0, 1.0, adv.numel(), device=adv.device, dtype=adv.dtype)
        source = "fixed"
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    out, flat = {"advantages": source}, {}
    for name, ctx in (("logitless", contextlib.nullcontext()), ("trl", trl_own_path(trainer))):
        trainer.model.zero_grad(set_to_none=True)
        with ctx:
            loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        flat[name] = torch.cat([p.grad.float().reshape(-1) for p in trainer.model.parameters() if p.grad is not None])
        out[name] = {"loss": loss.item(), "grad_norm": flat[name].norm().item()}
    trainer.model.zero_grad(set_to_none=True)
    out["grad_rel_l2_diff"] = ((flat["logitless"] - flat["trl"]).norm() / flat["trl"].norm().clamp(min=1e-30)).item()
    return out, inputs, current.float()


class DriftProbe(TrainerCallback):
    """After every optimizer step, the policy's KL from the starting model and its entropy on a
    fixed batch of the starting model's own samples (the parity batch): a per-token k3 estimate
    of KL(pi_0 || pi_theta) (``exp(d) - 1 - d`` with ``d = logp_theta - logp_0``), in nats,
    through logitless's log-probs. Unlike the sampled training batches, the batch never changes,
    so the curve shows the policy moving rather than the sampling noise."""

    def __init__(self, trainer: Any, inputs: dict, start_logps: torch.Tensor) -> None:
        self.trainer, self.start = trainer, start_logps
        self.ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        self.attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        self.mask = inputs["completion_mask"].float()
        self.kl: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        with torch.no_grad():
            logps, _, _ = self.trainer._get_per_token_logps_and_entropies(self.trainer.model, self.ids, self.attention,
                                                                          self.mask.size(1))
        d = logps.float() - self.start
        self.kl.append(((torch.expm1(d) - d) * self.mask).sum().item() / max(self.mask.sum().item(), 1.0))


def head_memory_estimate(sequences: int, length: int, vocab_size: int, hidden_size: int, chunk_bytes: int) -> dict:
    """The head's extra memory for one training pass over ``sequences x length`` tokens, in bytes, counted
    from the shapes: a plain head keeps the fp32 logits ``[tokens, V]`` for the backward and
    forms their gradient, as large again (``log_softmax``'s output is more still); logitless
    keeps at most ``chunk_bytes`` of logits at a time, one fp32 ``d weight`` ``[V, H]`` and a few
    fp32 values per token."""
    tokens = sequences * length
    logits = tokens * vocab_size * 4
    return {"sequences": sequences, "length": length, "tokens": tokens, "vocab_size": vocab_size,
            "hidden_size": hidden_size, "chunk_bytes": chunk_bytes,
            "plain_at_least": 2 * logits,
            "logitless_at_most": min(logits, chunk_bytes) + vocab_size * hidden_size * 4 + 16 * tokens}


def head_memory(trainer: Any, inputs: dict) -> dict:
    """Peak extra memory (bytes; GPU memory on CUDA, resident memory on CPU) of the head's loss,
    forward and backward, on the batch's final hidden states and the model's head weight:
    logits materialized as TRL does vs ``logitless.policy_loss``. Also the batch's token count
    and vocabulary size."""
    from ..model_heads import find_head

    model = trainer.model
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    t = inputs["completion_ids"].size(1)
    with torch.no_grad(), trainer.accelerator.autocast():
        hidden = model(input_ids=ids, attention_mask=am, logitless_hidden_states=True)[:, -t - 1:-1]
    weight = find_head(trainer.accelerator.unwrap_model(model)).weight.detach()
    batch = {"hidden": hidden.to(weight.dtype).contiguous(), "weight": weight.clone(), "ids": inputs["completion_ids"],
             "mask": inputs["completion_mask"].float(), "adv": inputs["advantages"].float(),
             "temperature": torch.tensor(float(trainer.temperature))}
    out = {"tokens": int(inputs["completion_mask"].numel()), "vocab_size": int(weight.shape[0])}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batch.pt"
        torch.save(batch, path)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
        for mode in ("plain", "logitless"):
            r = subprocess.run([sys.executable, "-c", _HEAD_MEMORY, mode, str(path)], capture_output=True, text=True,
                               env=env, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"head memory measurement ({mode}) failed:\n{r.stderr[-2000:]}")
            out[mode] = json.loads(r.stdout.strip().splitlines()[-1])["peak_bytes"]
    return out
