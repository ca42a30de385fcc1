"""TRL's GRPOTrainer / SFTTrainer against logitless's drop-ins on several processes, under the
engine ``accelerate launch`` was given (FSDP2 or DeepSpeed ZeRO-3): a few training steps of one
case per launch, each step's loss, gradient norm, step time and peak memory per GPU.

    bash scripts/gpu_multi.sh          # every case, then the table (what a user runs)

One case by hand (what gpu_multi.sh runs for each):

    accelerate launch --num_processes 2 --config_file scripts/accelerate/fsdp2.yaml \\
        scripts/gpu_multi.py --trainer grpo --impl logitless --out out/cases

and the table of the cases written so far: ``python scripts/gpu_multi.py --report out``.

The model is Qwen2.5-0.5B's architecture (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864,
vocabulary 151936, tied embeddings; ``--layers`` takes fewer) with random weights from a fixed
seed, built in every process before the engine shards it; the tokenizer is a word-level one built
here (tests/tiny_models.py), so nothing is downloaded. TRL's run and logitless's see the same
weights and the same batches (the trainers' seeded samplers), and GRPO the same completions:
they come from ``rollout_func=FixedCompletions`` (fixed texts per prompt, no sampling), scored by a
fixed reward function. Per step the loss and gradient norm can then be compared directly: they
differ only by the heads' bf16 rounding, which grows over the steps as the weights drift apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# A CPU-sized stand-in (gloo, --tiny) for checking the script itself.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Case:
    """One launch: which trainer, whose head, which engine, and the workload's size."""

    trainer: str  # "grpo" | "sft"
    impl: str  # "trl" | "logitless"
    engine: str  # "fsdp2" | "zero3" (the accelerate config's; recorded, the launch decides)
    steps: int
    batch: int  # sequences per device per step
    prompt_len: int
    completion_len: int  # GRPO: the longest completion; SFT: the sequence length
    layers: int
    tiny: bool
    untie: bool = False  # a separate lm_head instead of the tied embeddings
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.engine}-{self.trainer}-{self.impl}"


def _log(msg: str) -> None:
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"[gpu_multi {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _model_and_tokenizer(case: Case):
    from tiny_models import word_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    arch = dict(TINY if case.tiny else QWEN25_05B)
    arch["num_hidden_layers"] = case.layers or arch["num_hidden_layers"]
    arch["tie_word_embeddings"] = not case.untie
    v = arch["vocab_size"]
    tokenizer = word_tokenizer(v)
    torch.manual_seed(case.seed)  # the same weights in every process and for both heads
    config = Qwen2Config(**arch, pad_token_id=v - 3, eos_token_id=v - 2, bos_token_id=None)
    # Initialized on this process's GPU (seconds faster than the CPU for 0.5B parameters); the seeded
    # CUDA generator draws the same values on every GPU.
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model, tokenizer, arch


def _words(gen: torch.Generator, n: int, vocab: int) -> str:
    return " ".join(f"t{i}" for i in torch.randint(0, vocab - 3, (n,), generator=gen).tolist())


def _grpo(case: Case, model, tokenizer, vocab: int, args_common: dict):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from logitless.integrations.trl import FixedCompletions, LogitlessGRPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    gens = 8 if case.batch * world >= 8 else case.batch * world
    gen = torch.Generator().manual_seed(case.seed + 1)
    n_prompts = max(1, case.steps * case.batch * world // gens)
    prompts = [_words(gen, case.prompt_len, vocab) for _ in range(n_prompts)]
    # Completion lengths spread over [1/4, 1] of the longest; group members differ in length, so
    # the rewards below differ inside every group and every completion has a nonzero advantage.
    completions = {
        p: [
            _words(
                gen, int(torch.randint(case.completion_len // 4, case.completion_len + 1, (1,), generator=gen)), vocab
            )
            for _ in range(gens)
        ]
        for p in prompts
    }

    def reward(completions, **kwargs):
        return [float(len(c.split()) % 13) / 13.0 for c in completions]

    args = GRPOConfig(
        **args_common, num_generations=gens, max_completion_length=case.completion_len, beta=0.0, learning_rate=1e-6
    )
    cls = LogitlessGRPOTrainer if case.impl == "logitless" else GRPOTrainer
    return cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        rollout_func=FixedCompletions(completions, tokenizer),
    )


def _sft(case: Case, model, tokenizer, vocab: int, args_common: dict):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from logitless.integrations.trl_sft import LogitlessSFTTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    gen = torch.Generator().manual_seed(case.seed + 2)
    rows = [
        {
            "text": _words(
                gen, int(torch.randint(case.completion_len // 2, case.completion_len, (1,), generator=gen)), vocab
            )
        }
        for _ in range(case.steps * case.batch * world)
    ]
    args = SFTConfig(**args_common, max_length=case.completion_len, learning_rate=1e-5, packing=False)
    cls = LogitlessSFTTrainer if case.impl == "logitless" else SFTTrainer
    return cls(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)


def _step_recorder():
    """A TrainerCallback recording each optimizer step's wall time and every rank's peak memory."""
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()

    class StepRecorder(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - self._t0
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            peaks = [peak]
            if torch.distributed.is_initialized():
                peaks = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(peaks, peak)
            self.steps.append({"step": state.global_step, "step_time_s": dt, "peak_mem_gib": peaks})
            _log(f"step {state.global_step}: {dt:.3f} s, peak GiB per rank {[p and round(p, 3) for p in peaks]}")

    return StepRecorder()


def run_case(case: Case, out_dir: Path) -> None:
    t_start = time.perf_counter()
    cpu = not torch.cuda.is_available()
    _log(f"{case.name}: building the model ({'tiny' if case.tiny else 'Qwen2.5-0.5B'} config, random weights)")
    model, tokenizer, arch = _model_and_tokenizer(case)
    # The same in every process and in both heads' runs of a case, or the comparison means nothing.
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    args_common = dict(
        output_dir=str(Path(tempfile.gettempdir()) / "gpu_multi_trainer" / case.name),  # nothing is saved
        per_device_train_batch_size=case.batch,
        max_steps=case.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=case.seed,
        bf16=not cpu,
        use_cpu=cpu,  # FSDP2 needs GPUs: on a CPU accelerate runs DDP instead (ZeRO-3 runs on DeepSpeed's CPU path)
        gradient_accumulation_steps=1,
        max_grad_norm=1.0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    build = _grpo if case.trainer == "grpo" else _sft
    trainer = build(case, model, tokenizer, arch["vocab_size"], args_common)
    recorder = _step_recorder()
    trainer.add_callback(recorder)
    _log(f"{case.name}: training {case.steps} steps")
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    steps = []
    for rec, log in zip(recorder.steps, logs, strict=False):
        steps.append(
            {
                **rec,
                "loss": log.get("loss"),
                "grad_norm": log.get("grad_norm"),
                **({"reward": log["reward"]} if "reward" in log else {}),
                **({"logitless_active": log["logitless/active"]} if "logitless/active" in log else {}),
            }
        )
    sw = getattr(trainer, "logitless", None)
    engine = _engine_facts(trainer)
    checksums = [checksum]
    if torch.distributed.is_initialized():
        checksums = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(checksums, checksum)
    _log(f"{case.name}: engine {engine}")
    result = {
        "case": asdict(case),
        "name": case.name,
        "arch": arch,
        "steps": steps,
        "init_weight_checksum_per_rank": checksums,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "wall_s": time.perf_counter() - t_start,
        "logitless": None
        if sw is None
        else {
            "active": sw.active,
            "fused_loss": sw.fused_loss,
            "fused_logprobs": sw.fused_logprobs,
            "backend": sw.backend,
            "why_not": sw.why_not,
        },
        "env": _env(),
    }
    if int(os.environ.get("RANK", "0")) == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{case.name}.json").write_text(json.dumps(result, indent=1))
        _log(f"{case.name}: wrote {out_dir / (case.name + '.json')}")


def _engine_facts(trainer) -> dict:
    """What the engine did to the model, as evidence that the case ran under it: the wrapper's
    class, and how the head's parameters are held (FSDP2 DTensor / ZeRO-3 partitioned)."""
    from logitless.model_heads import find_head

    wrapped = trainer.model_wrapped
    head = find_head(trainer.accelerator.unwrap_model(trainer.model))
    return {
        "wrapped": type(wrapped).__name__,
        "model": type(trainer.model).__name__,
        "head_fsdp_module": None if head.fsdp is None else type(head.fsdp.module).__name__,
        "head_weight_type": type(head.weight).__name__,
        "head_zero3": head.zero3,
        "head_weight_local_shape": list(head.weight.shape),
        "head_ds_status": getattr(getattr(head.weight, "ds_status", None), "name", None),
    }


def _env() -> dict:
    import accelerate
    import transformers
    import trl

    cuda = torch.cuda.is_available()
    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
    }
    env.update(
        {
            k: os.environ[k]
            for k in (
                "ACCELERATE_USE_DEEPSPEED",
                "ACCELERATE_USE_FSDP",
                "FSDP_VERSION",
                "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                "ACCELERATE_MIXED_PRECISION",
            )
            if k in os.environ
        }
    )
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except Exception:  # not installed: FSDP2 only
        env["deepspeed"] = None
    return env


# ---- the report: one JSON and a table, ours against TRL per step ------------------------------


def _diff(ours, theirs) -> tuple[float | None, float | None]:
    if ours is None or theirs is None:
        return None, None
    d = abs(ours - theirs)
    return d, d / abs(theirs) if theirs else (0.0 if d == 0 else math.inf)


def _max_peak(per_step) -> float | None:
    peaks = [x for step in per_step for x in step if x is not None]
    return max(peaks) if peaks else None


def report(out: Path) -> dict:
    """Merge ``out/cases/*.json`` into ``out/gpu_multi.json`` and print ours against TRL per step."""
    cases = {}
    for f in sorted((out / "cases").glob("*.json")):
        r = json.loads(f.read_text())
        cases[r["name"]] = r
    pairs = []
    lines = [
        f"{'engine':6} {'trainer':7} {'step':>4} | {'loss trl':>11} {'loss ours':>11} {'|d|':>8} | "
        f"{'gnorm trl':>10} {'gnorm ours':>10} {'rel d':>8} | {'time trl':>8} {'ours':>8} | "
        f"{'peak GiB trl (per GPU)':>22} {'ours':>18}"
    ]
    for engine in ("fsdp2", "zero3"):
        for trainer in ("grpo", "sft"):
            theirs, ours = cases.get(f"{engine}-{trainer}-trl"), cases.get(f"{engine}-{trainer}-logitless")
            if theirs is None or ours is None:
                missing = [n for n, c in (("trl", theirs), ("logitless", ours)) if c is None]
                lines.append(f"{engine:6} {trainer:7}  (not run / failed: {', '.join(missing)})")
                pairs.append({"engine": engine, "trainer": trainer, "missing": missing})
                continue
            rows = []
            for a, b in zip(theirs["steps"], ours["steps"], strict=False):
                dl, rl = _diff(b["loss"], a["loss"])
                _, rg = _diff(b["grad_norm"], a["grad_norm"])
                rows.append(
                    {
                        "step": a["step"],
                        "loss_trl": a["loss"],
                        "loss_ours": b["loss"],
                        "loss_abs_diff": dl,
                        "loss_rel_diff": rl,
                        "grad_norm_trl": a["grad_norm"],
                        "grad_norm_ours": b["grad_norm"],
                        "grad_norm_rel_diff": rg,
                        "step_time_s_trl": a["step_time_s"],
                        "step_time_s_ours": b["step_time_s"],
                        "peak_mem_gib_trl": a["peak_mem_gib"],
                        "peak_mem_gib_ours": b["peak_mem_gib"],
                    }
                )

                def f(x, w, p):
                    return f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"

                def g(x, w):
                    return f"{x:{w}.1e}" if isinstance(x, (int, float)) else f"{'-':>{w}}"

                def mem(m):
                    return "/".join("-" if x is None else f"{x:.2f}" for x in m)

                lines.append(
                    f"{engine:6} {trainer:7} {a['step']:>4} | {f(a['loss'], 11, 5)} {f(b['loss'], 11, 5)} "
                    f"{g(dl, 8)} | {f(a['grad_norm'], 10, 4)} {f(b['grad_norm'], 10, 4)} {g(rg, 8)} | "
                    f"{f(a['step_time_s'], 8, 3)} {f(b['step_time_s'], 8, 3)} | "
                    f"{mem(a['peak_mem_gib']):>22} {mem(b['peak_mem_gib']):>18}"
                )
            later = rows[1:] or rows  # the first step carries one-time costs (compilation, allocator warm-up)
            pairs.append(
                {
                    "engine": engine,
                    "trainer": trainer,
                    "steps": rows,
                    # one set of initial weights in every process of both runs
                    "same_init": len(
                        set(theirs["init_weight_checksum_per_rank"] + ours["init_weight_checksum_per_rank"])
                    )
                    == 1,
                    "median_step_time_s_trl": statistics.median(r["step_time_s_trl"] for r in later),
                    "median_step_time_s_ours": statistics.median(r["step_time_s_ours"] for r in later),
                    "max_peak_mem_gib_trl": _max_peak(r["peak_mem_gib_trl"] for r in rows),
                    "max_peak_mem_gib_ours": _max_peak(r["peak_mem_gib_ours"] for r in rows),
                    "logitless": ours["logitless"],
                }
            )
    result = {
        "what": "TRL's trainers against logitless's drop-ins, 2 processes under accelerate launch "
        "(scripts/gpu_multi.py)",
        "pairs": pairs,
        "cases": cases,
    }
    (out / "gpu_multi.json").write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    for p in pairs:
        if "steps" in p:
            active = p["logitless"] and p["logitless"]["active"]
            print(
                f"{p['engine']}-{p['trainer']}: same initial weights {p['same_init']}; "
                f"median step {p['median_step_time_s_trl']:.3f} s (TRL) vs "
                f"{p['median_step_time_s_ours']:.3f} s (logitless); max peak {p['max_peak_mem_gib_trl']} vs "
                f"{p['max_peak_mem_gib_ours']} GiB per GPU; logitless active: {active}"
            )
    print(f"wrote {out / 'gpu_multi.json'}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", choices=("grpo", "sft"), default="grpo")
    ap.add_argument("--impl", choices=("trl", "logitless"), default="logitless")
    ap.add_argument(
        "--engine",
        choices=("fsdp2", "zero3"),
        default=None,
        help="recorded in the case's name; default: read from the accelerate launch environment",
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="sequences per device per step")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=512, help="GRPO: longest completion; SFT: sequence length")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the config's)")
    ap.add_argument("--tiny", action="store_true", help="a tiny config for checking the script on CPU")
    ap.add_argument("--untie", action="store_true", help="an lm_head of its own (the config ties it to the embeddings)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "cases")
    ap.add_argument("--report", type=Path, default=None, help="only merge <dir>/cases/*.json and print the table")
    a = ap.parse_args()
    if a.report is not None:
        report(a.report)
        return
    engine = a.engine or ("zero3" if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" else "fsdp2")
    case = Case(
        trainer=a.trainer,
        impl=a.impl,
        engine=engine,
        steps=a.steps,
        batch=a.batch,
        prompt_len=a.prompt_len,
        completion_len=a.completion_len,
        layers=a.layers,
        tiny=a.tiny,
        untie=a.untie,
    )
    run_case(case, a.out)


if __name__ == "__main__":
    main()
