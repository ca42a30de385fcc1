"""What the demo shows a person: a progress bar while it trains, then the plot, the summary
and the printed result."""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

CORRECT_KEY = "rewards/correctness_reward/mean"


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (all threads), seconds."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Phases:
    """One status line per set-up phase ("loading ...", then its wall and CPU time when done),
    with the times kept for the summary. CPU time is the figure to compare on a shared machine:
    wall time there says more about the neighbours."""

    def __init__(self) -> None:
        self.times: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def __call__(self, key: str, text: str) -> Iterator[None]:
        print(f"{text} ...", flush=True)
        t, c = time.perf_counter(), cpu_seconds()
        yield
        wall, cpu = time.perf_counter() - t, cpu_seconds() - c
        self.times[key] = {"seconds": wall, "cpu_seconds": cpu}
        print(f"  done: {wall:.0f} s, {cpu / 60:.1f} CPU-min", flush=True)


class Progress(TrainerCallback):
    """A tqdm bar over the GRPO steps showing the step's mean reward, the fraction of its sampled
    completions that are correct, and its wall time; keeps each step's values (TRL's logged
    loss, entropy and fraction of groups whose rewards are all equal, which get no gradient)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.rewards: list[float] = []
        self.accuracy: list[float] = []
        self.loss: list[float] = []
        self.entropy: list[float] = []
        self.constant_groups: list[float] = []
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
        for values, key in ((self.loss, "loss"), (self.entropy, "entropy"), (self.constant_groups,
                                                                             "frac_reward_zero_std")):
            values.append(float(logs[key]) if logs.get(key) is not None else float("nan"))
        self._bar.set_postfix(reward=f"{self.rewards[-1]:.2f}", correct=f"{self.accuracy[-1]:.2f}",
                              step=f"{self.step_seconds[-1] if self.step_seconds else 0:.1f}s")
        self._bar.update(state.global_step - self._bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        if self._bar is not None:
            self._bar.close()


def smooth(values: list[float], span: int = 5) -> list[float]:
    """Centred moving average over ``span`` steps (fewer at the ends), NaNs skipped."""
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - span // 2):i + span // 2 + 1] if not math.isnan(v)]
        out.append(sum(window) / len(window) if window else float("nan"))
    return out


def plot(progress: Progress, kl: list[float], before: float, after: float, title: str, path: Path) -> None:
    """Four panels over the GRPO steps: reward and sampled accuracy (raw, faint, and smoothed)
    with the held-out greedy accuracy before/after; TRL's loss; the KL from the starting model
    (``kl``, the drift probe); the policy's entropy on its samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(progress.rewards) + 1))
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    ax = axes[0, 0]
    for values, color, label in ((progress.rewards, "C0", "reward"), (progress.accuracy, "C1", "correct fraction")):
        ax.plot(steps, values, color=color, alpha=0.25, lw=1)
        ax.plot(steps, smooth(values), color=color, lw=2, label=f"{label} (sampled; 5-step mean)")
    end = max(len(steps), 1)
    ax.hlines([before], 1, end, colors="grey", linestyles="--", label=f"held-out greedy accuracy before: {before:.1%}")
    ax.hlines([after], 1, end, colors="green", linestyles="--", label=f"held-out greedy accuracy after: {after:.1%}")
    ax.set_ylim(-0.02, 1.25)
    ax.set_title("reward and accuracy", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    panels = ((axes[0, 1], progress.loss, "GRPO loss (TRL's log)"),
              (axes[1, 0], kl, "KL(start || policy), nats/token, fixed batch"),
              (axes[1, 1], progress.entropy, "entropy of the sampled tokens, nats"))
    for ax, values, name in panels:
        ax.plot(steps[:len(values)], values, color="C2", alpha=0.35, lw=1)
        ax.plot(steps[:len(values)], smooth(values), color="C2", lw=2)
        ax.set_title(name, fontsize=9)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("GRPO step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_samples(header: str, questions: list[str], texts: list[str], marks: list[bool]) -> None:
    print(header)
    for q, t, ok in zip(questions, texts, marks, strict=True):
        print(f"  {'✓' if ok else '✗'} {q}  ->  {t.strip()!r}")


def print_result(s: dict, out_dir: Path) -> None:
    ev, one, mem, est = s["eval"], s["one_step"], s.get("head_memory"), s["head_memory_estimate"]
    print(f"\nlogitless demo: {s['model']} on {s['device']}, {s['config']['steps']} GRPO steps, "
          f"{s['seconds']:.0f} s ({s['train_seconds']:.0f} s training), {s['cpu_seconds'] / 60:.1f} CPU-min")
    print(f"held-out accuracy (greedy, {ev['size']} problems): {ev['before']:.1%} -> {ev['after']:.1%}")
    lg, tr = one["logitless"], one["trl"]
    fixed = "; every reward equal, so advantages set to a fixed ramp" if one["advantages"] == "fixed" else ""
    print(f"one GRPO step, same real batch, before training (old log-probs 0.1 nats off{fixed}):")
    print("                                                   loss          grad norm (all params)")
    print(f"  logitless                                       {lg['loss']: .6e}   {lg['grad_norm']:.6e}")
    print(f"  TRL 1.16 own path                               {tr['loss']: .6e}   {tr['grad_norm']:.6e}")
    print(f"  |loss difference| = {abs(lg['loss'] - tr['loss']):.1e};  "
          f"||grad difference|| / ||grad|| = {one['grad_rel_l2_diff']:.1e}")
    gib = 2**30
    print(f"head memory of one training pass at {est['tokens']} tokens ({est['sequences']} sequences of "
          f"{est['length']}) x V={est['vocab_size']}, "
          f"from the shapes: logits materialized >= {est['plain_at_least'] / gib:.1f} GiB (fp32 logits and their "
          f"gradient), logitless <= {est['logitless_at_most'] / gib:.1f} GiB ({est['chunk_bytes'] / gib:.0f} GiB "
          f"chunk budget + fp32 d weight)")
    if mem:
        mib = 2**20
        print(f"measured on this batch ({mem['tokens']} tokens), peak extra GPU memory: logits materialized "
              f"{mem['plain'] / mib:.0f} MiB, logitless {mem['logitless'] / mib:.0f} MiB")
    print(f"plot: {out_dir / 'reward.png'}; summary: {out_dir / 'summary.json'}")
