"""``logitless demo``: train a small Qwen2-architecture model with TRL's GRPOTrainer through
logitless on an embedded verifiable task, and show that the numbers match TRL's own path.

The task (verifiable, checked by a rule): answer with words from the first half of the
dictionary. The reward of a completion is the fraction of its tokens whose id is below
``V / 2``. A random model scores ~0.5; GRPO has to move probability mass over half of a
32k-word vocabulary through the head, which is the part logitless computes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

_MEMORY_SNIPPET = r"""
import json, os, sys, threading, time, torch
from logitless import PassOptions, PolicyConfig, policy_loss
mode, n, v, h, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
b = 8
t = n // b
hid = (torch.randn(b, t, h, device=device) / h**0.5).requires_grad_()
w = (torch.randn(v, h, device=device) * 2).requires_grad_()
ids = torch.randint(0, v, (b, t), device=device)
mask = torch.ones(b, t, device=device)
adv = torch.randn(b, device=device)
old = torch.randn(b, t, device=device) * 0.1 - 5
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
# ru_maxrss is a high-water mark of the whole process (imports included); sample the current RSS instead.
peak_rss, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak_rss[0] = max(peak_rss[0], rss()); time.sleep(0.0005)
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
else:
    base = rss(); threading.Thread(target=sample, daemon=True).start()
if mode == "plain":
    logits = (hid @ w.T).float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    c1 = torch.exp(logp - old); c2 = c1.clamp(0.8, 1.2)
    loss = (-torch.min(c1 * adv[:, None], c2 * adv[:, None]) * mask).sum() / mask.sum()
else:
    loss, _ = policy_loss(hid, w, ids, mask, adv, old, config=PolicyConfig(loss_type="dapo"),
                          options=PassOptions(chunk_bytes=256 * 2**20))
loss.backward()
if device == "cuda":
    torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
else:
    done.set(); peak = max(peak_rss[0], rss()) - base
print(json.dumps({"peak_bytes": peak}))
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=40, help="GRPO optimizer steps (default 40)")
    p.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size (default 32768)")
    p.add_argument("--hidden-size", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--completion-length", type=int, default=12, help="max completion tokens (default 12)")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--memory-tokens", type=int, default=8192,
                   help="tokens of the head-memory comparison (default 8192; 0 skips it)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    p.add_argument("--output-dir", default="demo_out", help="where the plot and summary go (default demo_out)")
    p.add_argument("--learning-rate", type=float, default=2e-2, help="AdamW learning rate (default 2e-2)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _build_model(path: Path, vocab: int, hidden: int, layers: int, seed: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = {"LOW": 0, "HIGH": 1, **{f"w{i}": i for i in range(2, vocab - 3)},
             "<pad>": vocab - 3, "<eos>": vocab - 2, "<unk>": vocab - 1}
    tk = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, pad_token_id=vocab - 3, eos_token_id=vocab - 2, bos_token_id=None)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def _dataset(vocab: int, n: int, seed: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        words = " ".join(f"w{int(x)}" for x in torch.randint(2, vocab - 3, (3,), generator=g))
        prompts.append(f"LOW {words}")
    return Dataset.from_dict({"prompt": prompts})


def _reward_factory(vocab: int, tokenizer):
    half = vocab // 2

    def half_reward(completion_ids, **_):
        """Fraction of completion tokens in the lower half of the vocabulary."""
        out = []
        for ids in completion_ids:
            ids = [i for i in ids if i < vocab - 3]  # ignore pad/eos
            out.append(sum(i < half for i in ids) / len(ids) if ids else 0.0)
        return out

    return half_reward


def _one_step_comparison(trainer, batch) -> dict:
    """Loss and gradient norm for the same inputs through logitless and TRL's own path."""
    import contextlib

    from .integrations.trl import trl_own_path

    inputs = trainer._generate_and_score_completions(batch)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    out, flat = {}, {}
    for name, ctx in (("logitless", contextlib.nullcontext()), ("trl", trl_own_path(trainer))):
        trainer.model.zero_grad(set_to_none=True)
        with ctx:
            loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        flat[name] = torch.cat([p.grad.float().reshape(-1) for p in trainer.model.parameters() if p.grad is not None])
        out[name] = {"loss": loss.item(), "grad_norm": flat[name].norm().item()}
    trainer.model.zero_grad(set_to_none=True)
    out["grad_rel_l2_diff"] = ((flat["logitless"] - flat["trl"]).norm() / flat["trl"].norm().clamp(min=1e-30)).item()
    return out


def _head_memory(tokens: int, vocab: int, hidden: int, device: str) -> dict:
    out = {}
    for mode in ("plain", "logitless"):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get(
            "PYTHONPATH", "")])}
        r = subprocess.run([sys.executable, "-c", _MEMORY_SNIPPET, mode, str(tokens), str(vocab), str(hidden),
                            device], capture_output=True, text=True, env=env, check=True)
        out[mode] = json.loads(r.stdout.strip().splitlines()[-1])["peak_bytes"]
    return out


def _plot(rewards: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(rewards) + 1), rewards, marker="o", ms=3)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_title("logitless demo: GRPO through logitless (TRL GRPOTrainer)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig

    from .integrations.trl import LogitlessGRPOTrainer

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model_dir = Path(tempfile.mkdtemp(prefix="logitless-demo-"))
    _build_model(model_dir, args.vocab_size, args.hidden_size, args.layers, args.seed)
    # AutoTokenizer would map the Qwen2 config to Qwen2's BPE tokenizer; this one is word-level.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    prompts_per_step = 2
    config = GRPOConfig(
        output_dir=str(model_dir / "run"), per_device_train_batch_size=prompts_per_step * args.generations,
        num_generations=args.generations, max_completion_length=args.completion_length, max_steps=args.steps,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", beta=0.0, temperature=1.0, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=device == "cpu", bf16=device == "cuda", seed=args.seed,
        disable_tqdm=False)
    rewards: list[float] = []

    class RewardLog(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **_):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer = LogitlessGRPOTrainer(
        model=str(model_dir), reward_funcs=_reward_factory(args.vocab_size, tokenizer), args=config,
        train_dataset=_dataset(args.vocab_size, 4 * prompts_per_step * max(args.steps, 1), args.seed),
        processing_class=tokenizer, callbacks=[RewardLog()])
    # One step compared on the untrained model, where completions still differ within a group.
    batch = [{"prompt": p} for p in _dataset(args.vocab_size, prompts_per_step, args.seed + 1)["prompt"]
             for _ in range(args.generations)]
    comparison = _one_step_comparison(trainer, batch)
    trainer.train()
    memory = _head_memory(args.memory_tokens, args.vocab_size, args.hidden_size, device) if args.memory_tokens else {}
    _plot(rewards, out_dir / "reward.png")

    k = max(1, min(5, len(rewards) // 4))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    summary = {"device": device, "steps": args.steps, "vocab_size": args.vocab_size, "rewards": rewards,
               "reward_first": first, "reward_last": last, "one_step": comparison, "head_peak_bytes": memory,
               "seconds": time.time() - t0}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    lg, tr = comparison["logitless"], comparison["trl"]
    print(f"\nlogitless demo on {device}: Qwen2-architecture model, V={args.vocab_size}, {args.steps} GRPO steps, "
          f"{summary['seconds']:.0f} s")
    print(f"reward (mean of first {k} steps -> last {k} steps): {first:.3f} -> {last:.3f}")
    print("one GRPO step on the same inputs (before training):   loss          grad norm (all params)")
    print(f"  logitless                                        {lg['loss']: .6e}   {lg['grad_norm']:.6e}")
    print(f"  TRL 1.16 own path                                {tr['loss']: .6e}   {tr['grad_norm']:.6e}")
    print(f"  |loss difference| = {abs(lg['loss'] - tr['loss']):.1e};  "
          f"||grad difference|| / ||grad|| = {comparison['grad_rel_l2_diff']:.1e}")
    if memory:
        gib = 2**30
        print(f"head peak memory, fwd+bwd at N={args.memory_tokens} tokens x V={args.vocab_size} "
              f"(extra {'GPU' if device == 'cuda' else 'RSS'} memory): plain PyTorch {memory['plain'] / gib:.2f} GiB, "
              f"logitless {memory['logitless'] / gib:.2f} GiB")
    print(f"reward curve: {out_dir / 'reward.png'}; summary: {out_dir / 'summary.json'}")
    return 0
