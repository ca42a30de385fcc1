"""What the demo shows a person: a progress bar while it trains, then the plot, the summary
and the printed result."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

CORRECT_KEY = "rewards/correctness_reward/mean"


class Progress(TrainerCallback):
    """A tqdm bar over the GRPO steps showing the step's mean reward, the fraction of its sampled
    completions that are correct, and its wall time; keeps each step's values."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.rewards: list[float] = []
        self.accuracy: list[float] = []
        self.step_seconds: list[float] = []
        self._bar: Any = None
        self._t = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        from tqdm.auto import tqdm

        self._bar = tqdm(total=state.max_steps, desc="GRPO", unit="step", disable=not self.enabled)
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_seconds.append(now - self._t)
        self._t = now

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        self.rewards.append(float(logs["reward"]))
        self.accuracy.append(float(logs.get(CORRECT_KEY, float("nan"))))
        self._bar.set_postfix(reward=f"{self.rewards[-1]:.2f}", correct=f"{self.accuracy[-1]:.2f}",
                              step=f"{self.step_seconds[-1] if self.step_seconds else 0:.1f}s")
        self._bar.update(state.global_step - self._bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        if self._bar is not None:
            self._bar.close()


def plot(progress: Progress, before: float, after: float, title: str, path: Path) -> None:
    """Training reward and sampled accuracy per step, held-out greedy accuracy before/after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(progress.rewards) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, progress.rewards, marker="o", ms=3, label="mean reward (sampled, training)")
    ax.plot(steps, progress.accuracy, marker=".", ms=3, alpha=0.7, label="correct fraction (sampled, training)")
    end = max(len(progress.rewards), 1)
    ax.hlines([before], 0, end, colors="grey", linestyles="--", label=f"held-out greedy accuracy before: {before:.1%}")
    ax.hlines([after], 0, end, colors="green", linestyles="--", label=f"held-out greedy accuracy after: {after:.1%}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.22)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_samples(header: str, questions: list[str], texts: list[str], marks: list[bool]) -> None:
    print(header)
    for q, t, ok in zip(questions, texts, marks, strict=True):
        print(f"  {'✓' if ok else '✗'} {q}  ->  {t.strip()!r}")


def print_result(s: dict, out_dir: Path) -> None:
    ev, one, mem = s["eval"], s["one_step"], s.get("head_memory")
    print(f"\nlogitless demo: {s['model']} on {s['device']}, {s['config']['steps']} GRPO steps, "
          f"{s['seconds']:.0f} s ({s['train_seconds']:.0f} s training)")
    print(f"held-out accuracy (greedy, {ev['size']} problems): {ev['before']:.1%} -> {ev['after']:.1%}")
    lg, tr = one["logitless"], one["trl"]
    print("one GRPO step, same real batch, before training (old log-probs 0.1 nats off):")
    print("                                                   loss          grad norm (all params)")
    print(f"  logitless                                       {lg['loss']: .6e}   {lg['grad_norm']:.6e}")
    print(f"  TRL 1.16 own path                               {tr['loss']: .6e}   {tr['grad_norm']:.6e}")
    print(f"  |loss difference| = {abs(lg['loss'] - tr['loss']):.1e};  "
          f"||grad difference|| / ||grad|| = {one['grad_rel_l2_diff']:.1e}")
    if mem:
        mib = 2**20
        kind = "GPU memory" if s["device"] == "cuda" else "resident memory"
        print(f"head loss fwd+bwd on that batch ({mem['tokens']} tokens x V={mem['vocab_size']}), peak extra {kind}: "
              f"logits materialized {mem['plain'] / mib:.0f} MiB, logitless {mem['logitless'] / mib:.0f} MiB")
    print(f"plot: {out_dir / 'reward.png'}; summary: {out_dir / 'summary.json'}")
