"""End-to-end GRPO training step: TRL's own path against logitless, on real architectures.

One *step* is what ``GRPOTrainer.training_step`` does with a batch that is already generated
and scored: the policy's forward over prompt + completion, the GRPO loss (``compute_loss`` on
TRL's batch dict), the backward, and the optimizer step. Generation, rewards and the rollout
log-probs are excluded. Both paths run on the same model object, built from a ``transformers``
config with random weights (nothing is downloaded):

* **trl**: a plain ``trl.GRPOTrainer`` (``_compute_loss``; TRL 1.16 asks the model's forward
  for log-probs with transformers' ``fused_lm_head=True``);
* **logitless**: :class:`~logitless.integrations.trl.LogitlessGRPOTrainer`, same arguments;
* **trl-logits**: ``trl.GRPOTrainer`` with the log-prob path it had through TRL 1.15 and that
  frameworks without a fused head still have: the model's ``[B, T, V]`` logits materialized,
  then TRL's ``selective_log_softmax`` and ``entropy_from_logits`` (what a user who is not on
  TRL 1.16's fused head pays).

The ``GRPOConfig`` is TRL's default (``loss_type="dapo"``, ``beta=0``, gradient checkpointing
on). The optimizer is plain SGD without momentum for every model: it keeps no state, so the
7-8B models fit an 80 GB GPU with their bf16 weights and gradients (AdamW's two fp32 moments
would add 8 bytes per parameter, 61 GB at 7.6B), and the memory difference between the two
paths is the loss path's alone.

**logitless-skip** rows (``LogitlessConfig(skip_zero_advantage=True)``) run the logitless step on the
same batch with a fraction of its completions' advantages set to exactly 0 (a reward-constant
group's), which that trainer removes from the forward and backward; they are compared with the
trl and logitless rows of the same batch (whose step does not depend on the advantages' values).

Per model, in this order: one step's loss and gradients of both paths on the same weights and
batch (with off-policy old log-probs, so the loss depends on the log-probs); the largest
micro-batch that fits, per path: batch 1, the completion length doubled until the step runs
out of memory (or the token cap is reached); then per (batch size, completion length) and
path: median step time, peak GPU memory (``torch.cuda.max_memory_allocated``, weights
included), and the bytes autograd saves for the backward during the loss's forward (every
device; checkpointed layers' own activations are recomputed, not saved); then per fraction of
zero advantages, the skip step's parity with trl (every parameter's gradient) and its timed rows.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .timing import is_oom, synchronize

# Configs of the published checkpoints (config.json of each), random weights.
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                   num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                   tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)),
    "qwen2.5-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                 tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6)),
    "llama3-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5)),
    # CPU runs (CI): a vocabulary far larger than the hidden size, as in real heads.
    "tiny-qwen2": ("qwen2", dict(vocab_size=4099, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
}
GPU_MODELS = ("qwen2.5-1.5b", "qwen2.5-7b")
FULL_GPU_MODELS = (*GPU_MODELS, "llama3-8b")
PATHS = ("trl", "logitless", "trl-logits")
SKIP_PATH = "logitless-skip"
LR = 1e-6


@dataclass(frozen=True)
class E2EOptions:
    """What one ``logitless bench --e2e`` run measures.

    Attributes:
        device: where the model runs.
        dtype: the model's parameter dtype (bf16 on GPUs; fp32 makes the parity exact on CPUs).
        models: names of :data:`ARCHS`.
        completion_lengths, batch_sizes: the grid of timed steps (every pair).
        prompt_length: prompt tokens of every sequence.
        max_tokens: cap of the largest-micro-batch search (tokens per micro-batch); 0 skips it.
        reps: timed steps per grid point (after one warm-up step).
        seed: weights and batches.
        deadline: ``time.monotonic()`` after which no new step starts, or ``None``.
        zero_advantage_fractions: fractions of each batch's completions given advantage 0 for
            the logitless-skip rows (empty: no such rows).
    """

    device: torch.device
    dtype: torch.dtype
    models: tuple[str, ...]
    completion_lengths: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    prompt_length: int
    max_tokens: int
    reps: int = 3
    seed: int = 0
    deadline: float | None = None
    zero_advantage_fractions: tuple[float, ...] = (0.25, 0.5)


def build_model(name: str, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The architecture ``name`` of :data:`ARCHS` with random weights, in training mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, kw = ARCHS[name]
    config = AutoConfig.for_model(family, max_position_embeddings=1 << 18, use_cache=False, **kw)
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


def _tokenizer():
    # GRPOTrainer needs a tokenizer for its pad / eos ids; no text is ever encoded here.
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _materialized_logits_trainer() -> type:
    """``GRPOTrainer`` with TRL 1.15's ``_get_per_token_logps_and_entropies``: the logits of the
    last ``logits_to_keep + 1`` positions materialized, divided by the temperature, then
    ``selective_log_softmax`` and (no grad) ``entropy_from_logits`` (TRL 1.15,
    ``trl/trainer/grpo_trainer.py``)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    class MaterializedLogitsGRPOTrainer(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **_):
            batch_size = batch_size or input_ids.size(0)
            all_logps, all_entropies = [], []
            for start in range(0, input_ids.size(0), batch_size):
                ids = input_ids[start:start + batch_size]
                with self.accelerator.autocast():
                    logits = model(input_ids=ids, attention_mask=attention_mask[start:start + batch_size],
                                   logits_to_keep=logits_to_keep + 1).logits
                logits = logits[:, :-1, :][:, -logits_to_keep:, :] / self.temperature
                all_logps.append(selective_log_softmax(logits, ids[:, -logits_to_keep:]))
                if compute_entropy:
                    with torch.no_grad():
                        all_entropies.append(entropy_from_logits(logits))
            entropies = torch.cat(all_entropies) if compute_entropy else None
            return torch.cat(all_logps), entropies, None

    return MaterializedLogitsGRPOTrainer


def build_trainers(model: torch.nn.Module, device: torch.device, out_dir: str) -> dict[str, Any]:
    """One trainer per path of :data:`PATHS` over ``model``, TRL's default ``GRPOConfig``;
    gradient checkpointing enabled as ``Trainer.train`` would."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ..integrations.config import LogitlessConfig
    from ..integrations.trl import LogitlessGRPOTrainer

    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=2, num_generations=2, report_to=[],
                      use_cpu=device.type == "cpu", bf16=model.dtype == torch.bfloat16 and device.type == "cuda",
                      logging_steps=1)
    kw = dict(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
              train_dataset=Dataset.from_dict({"prompt": ["p", "q"]}), processing_class=_tokenizer())
    trainers = {"trl": GRPOTrainer(**kw), "logitless": LogitlessGRPOTrainer(**kw),
                "trl-logits": _materialized_logits_trainer()(**kw),
                SKIP_PATH: LogitlessGRPOTrainer(**kw, logitless_config=LogitlessConfig(skip_zero_advantage=True))}
    for t in trainers.values():
        t.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop, which is not run here
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    return trainers


def make_batch(batch: int, prompt: int, completion: int, vocab: int, device: torch.device,
               seed: int) -> dict[str, torch.Tensor]:
    """TRL's batch dict after generation: random ids, full prompts, completions of random length
    in ``[completion / 2, completion]`` (the first one full), per-sequence advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prompt + completion), generator=g)
    lengths = torch.randint(max(1, completion // 2), completion + 1, (batch,), generator=g)
    lengths[0] = completion
    mask = (torch.arange(completion)[None, :] < lengths[:, None]).long()
    out = dict(prompt_ids=ids[:, :prompt], prompt_mask=torch.ones(batch, prompt, dtype=torch.long),
               completion_ids=ids[:, prompt:], completion_mask=mask, advantages=torch.randn(batch, generator=g),
               num_items_in_batch=mask.sum().float())
    return {k: v.to(device) for k, v in out.items()}


def with_zero_advantages(batch: dict[str, torch.Tensor], fraction: float) -> tuple[dict[str, torch.Tensor], int]:
    """``batch`` with the advantages of its last ``round(fraction · B)`` completions set to 0
    (those of a reward-constant group), and that count."""
    b = batch["advantages"].shape[0]
    zero = min(b, int(fraction * b + 0.5))
    adv = batch["advantages"].clone()
    adv[b - zero:] = 0.0
    return dict(batch, advantages=adv), zero


@contextlib.contextmanager
def saved_bytes_counter(model: torch.nn.Module) -> Iterator[dict[str, int]]:
    """Counts the bytes of distinct storages autograd saves for the backward inside the block
    (``torch.autograd.graph.saved_tensors_hooks``), the storages of ``model``'s parameters
    (which every path keeps anyway, views of them included) excepted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    result = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result["bytes"] = sum(seen.values())


def _step_fn(trainer: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor],
             opt: torch.optim.Optimizer) -> Callable[[dict[str, int] | None], float]:
    def step(saved: dict[str, int] | None = None) -> float:
        with saved_bytes_counter(model) if saved is not None else contextlib.nullcontext() as counter:
            loss = trainer.compute_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if saved is not None:
            saved.update(counter)
        return float(loss.detach())

    return step


def _cleanup(model: torch.nn.Module, device: torch.device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(step: Callable[..., float], device: torch.device) -> tuple[float, int | None, int | None]:
    """(milliseconds, peak bytes, bytes allocated before) of one call of ``step``."""
    synchronize(device)
    base = peak = None
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step()
    synchronize(device)
    ms = (time.perf_counter() - t0) * 1e3
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    return ms, peak, base


def _expired(opts: E2EOptions) -> bool:
    return opts.deadline is not None and time.monotonic() > opts.deadline


def _run_point(trainer: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
               opts: E2EOptions, reps: int) -> dict[str, Any]:
    """One warm-up step (which also counts the saved bytes), then ``reps`` timed ones."""
    rec: dict[str, Any] = {"status": "ok"}
    if _expired(opts):
        return {"status": "skipped", "reason": "time budget spent"}
    step = _step_fn(trainer, model, batch, opt)
    try:
        saved: dict[str, int] = {}
        t0 = time.perf_counter()
        rec["loss"] = step(saved)
        synchronize(opts.device)
        rec["first_step_s"] = time.perf_counter() - t0
        rec["saved_bytes"] = saved["bytes"]
        times, peaks = [], []
        for _ in range(reps):
            ms, peak, base = _timed(step, opts.device)
            times.append(round(ms, 3))
            if peak is not None:
                peaks.append(peak)
                rec["base_bytes"] = base
        if times:
            rec["times_ms"] = times
            rec["time_ms"] = statistics.median(times)
        if peaks:
            rec["peak_bytes"] = max(peaks)
    except Exception as e:  # recorded, and the run goes on, as in the head benchmark
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        rec = {"status": "oom" if is_oom(e) else "error", "reason": reason}
    finally:
        _cleanup(model, opts.device)
    return rec


def _off_policy(trainer: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device,
                seed: int) -> dict[str, torch.Tensor]:
    """``batch`` with old log-probs 0.1 nats (Gaussian, from ``seed``) off the model's current ones,
    so that ratios differ from 1 and the loss depends on the log-probs."""
    b, c = batch["completion_ids"].shape
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        cur, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, am, c)
    return dict(batch, old_per_token_logps=cur.float() + 0.1 * torch.randn(b, c, generator=g).to(device))


def parity(trainers: dict[str, Any], model: torch.nn.Module, batch: dict[str, torch.Tensor],
           device: torch.device) -> dict[str, Any]:
    """Loss, gradient norm and head gradient of every path on the same weights and batch (no
    optimizer step), with old log-probs 0.1 nats off the current ones (so ratios differ from 1
    and the loss depends on the log-probs)."""
    from ..model_heads import find_head

    b, c = batch["completion_ids"].shape
    batch = _off_policy(trainers["logitless"], model, batch, device, seed=1234)
    head_weight = find_head(model).weight
    out: dict[str, Any] = {"batch_size": b, "completion_length": c}
    grads = {}
    for path in PATHS:
        model.zero_grad(set_to_none=True)
        loss = trainers[path].compute_loss(model, batch)
        loss.backward()
        norms = torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None])
        out[f"{path}_loss"] = float(loss.detach())
        out[f"{path}_grad_norm"] = float(norms.norm())
        grads[path] = head_weight.grad.float().clone()
        del loss
    ref = grads["trl"]
    out["loss_abs_diff"] = abs(out["logitless_loss"] - out["trl_loss"])
    out["grad_norm_rel_diff"] = abs(out["logitless_grad_norm"] - out["trl_grad_norm"]) / out["trl_grad_norm"]
    out["head_grad_rel_diff"] = float((grads["logitless"] - ref).norm() / ref.norm())
    del grads, ref
    _cleanup(model, device)
    return out


def skip_parity(trainers: dict[str, Any], model: torch.nn.Module, batch: dict[str, torch.Tensor],
                device: torch.device) -> dict[str, Any]:
    """The logitless-skip step against TRL's on ``batch`` (some advantages 0), same weights, old
    log-probs 0.1 nats off: loss, and every parameter's gradient (TRL's kept on the host, one
    parameter back on the device at a time)."""
    b, c = batch["completion_ids"].shape
    batch = _off_policy(trainers["logitless"], model, batch, device, seed=4321)
    params = [p for p in model.parameters() if p.requires_grad]
    losses, trl_grads = {}, []
    for path in ("trl", SKIP_PATH):
        model.zero_grad(set_to_none=True)
        loss = trainers[path].compute_loss(model, batch)
        loss.backward()
        losses[path] = float(loss.detach())
        if path == "trl":
            trl_grads = [None if p.grad is None else p.grad.to("cpu", copy=True) for p in params]
        del loss
    diff_sq = ref_sq = 0.0
    worst = 0.0
    for p, ref in zip(params, trl_grads, strict=True):
        if ref is None:
            continue
        ref = ref.to(device).float()
        mine = torch.zeros_like(ref) if p.grad is None else p.grad.float()
        d = float((mine - ref).norm())
        diff_sq += d * d
        ref_sq += float(ref.norm()) ** 2
        worst = max(worst, float((mine - ref).abs().max()))
    _cleanup(model, device)
    return {"batch_size": b, "completion_length": c, "trl_loss": losses["trl"], "skip_loss": losses[SKIP_PATH],
            "loss_abs_diff": abs(losses[SKIP_PATH] - losses["trl"]),
            "grad_rel_diff": (diff_sq ** 0.5) / max(ref_sq ** 0.5, 1e-30), "grad_max_abs_diff": worst}


def run_skip(trainers: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer, opts: E2EOptions,
             vocab: int, log: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per fraction of zero advantages: the parity with TRL (on the largest batch size at the
    shortest completion length), then the timed logitless-skip step at every grid point."""
    parities, steps = [], []
    for f in opts.zero_advantage_fractions:
        batch = make_batch(max(opts.batch_sizes), opts.prompt_length, min(opts.completion_lengths), vocab,
                           opts.device, opts.seed + 7)
        batch, zero = with_zero_advantages(batch, f)
        try:
            p = skip_parity(trainers, model, batch, opts.device)
        except Exception as e:
            if not is_oom(e):
                raise
            p = {"status": "oom"}
        finally:
            _cleanup(model, opts.device)
        parities.append({"zero_advantage_fraction": f, "zero_rows": zero, **p})
        if "grad_rel_diff" in p:
            log(f"  skip {f:.0%} ({zero} of {p['batch_size']} rows): loss |Δ| vs trl {p['loss_abs_diff']:.1e}, "
                f"gradient rel diff {p['grad_rel_diff']:.1e}")
        del batch
    for b in opts.batch_sizes:
        for c in opts.completion_lengths:
            base = make_batch(b, opts.prompt_length, c, vocab, opts.device, opts.seed + b * c)
            for f in opts.zero_advantage_fractions:
                batch, zero = with_zero_advantages(base, f)
                r = _run_point(trainers[SKIP_PATH], model, opt, batch, opts, opts.reps)
                r = {"path": SKIP_PATH, "zero_advantage_fraction": f, "zero_rows": zero, "batch_size": b,
                     "completion_length": c, "tokens": b * (opts.prompt_length + c),
                     "completion_tokens": int(batch["completion_mask"].sum()), **r}
                steps.append(r)
                log(_line(r) + f" ({zero} of {b} advantages 0)")
                del batch
            del base
    return parities, steps


def max_fit(trainer: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, opts: E2EOptions,
            log: Callable[[str], None], path: str) -> dict[str, Any]:
    """Largest micro-batch whose step fits: batch 1, ``prompt_length`` prompt tokens, the
    completion doubled from the grid's smallest length until the step runs out of memory or
    the micro-batch would exceed ``max_tokens``."""
    vocab = model.config.vocab_size
    c = min(opts.completion_lengths)
    out: dict[str, Any] = {"batch_size": 1, "max_fit_tokens": None, "max_fit_completion_length": None,
                           "first_oom_tokens": None, "capped": False, "tried": []}
    while True:
        tokens = opts.prompt_length + c
        if tokens > opts.max_tokens:
            out["capped"] = True
            break
        if _expired(opts):
            out["stopped"] = "time budget spent"
            break
        batch = make_batch(1, opts.prompt_length, c, vocab, opts.device, opts.seed + c)
        rec = _run_point(trainer, model, opt, batch, opts, reps=0)
        del batch
        out["tried"].append({"tokens": tokens, "status": rec["status"], "first_step_s": rec.get("first_step_s")})
        log(f"  max micro-batch {path:10s} {tokens:7d} tokens: {rec['status']}")
        if rec["status"] != "ok":
            out["first_oom_tokens"] = tokens if rec["status"] == "oom" else None
            break
        out["max_fit_tokens"], out["max_fit_completion_length"] = tokens, c
        c *= 2
    return out


def run_model(name: str, opts: E2EOptions, log: Callable[[str], None]) -> dict[str, Any]:
    """Every measurement of one architecture → its record."""
    t0 = time.perf_counter()
    model = build_model(name, opts.device, opts.dtype, opts.seed)
    family, kw = ARCHS[name]
    rec: dict[str, Any] = {"model": name, "family": family, "params": sum(p.numel() for p in model.parameters()),
                           "hidden_size": kw["hidden_size"], "vocab_size": kw["vocab_size"],
                           "layers": kw["num_hidden_layers"], "dtype": str(opts.dtype).removeprefix("torch."),
                           "prompt_length": opts.prompt_length}
    log(f"== {name}: {rec['params'] / 1e9:.2f}B parameters, H={rec['hidden_size']} V={rec['vocab_size']}")
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # TRL/transformers warn about the unused generation setup; nothing here generates.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        trainers = build_trainers(model, opts.device, tmp)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
        rec["setup_s"] = time.perf_counter() - t0
        small = make_batch(min(opts.batch_sizes), opts.prompt_length, min(opts.completion_lengths),
                           rec["vocab_size"], opts.device, opts.seed)
        try:
            rec["parity"] = parity(trainers, model, small, opts.device)
        except Exception as e:
            if not is_oom(e):
                raise
            rec["parity"] = {"status": "oom"}
        finally:
            _cleanup(model, opts.device)
        p = rec["parity"]
        if "loss_abs_diff" in p:
            log(f"  same step, same weights: loss trl {p['trl_loss']:.6f} logitless {p['logitless_loss']:.6f}, "
                f"grad norm rel diff {p['grad_norm_rel_diff']:.1e}, head grad rel diff {p['head_grad_rel_diff']:.1e}")
        # The search first: under a time budget, the grid's largest points are what gets cut.
        if opts.max_tokens > 0:
            rec["max_fit"] = {path: max_fit(trainers[path], model, opt, opts, log, path) for path in PATHS}
        rec["steps"] = []
        for b in opts.batch_sizes:
            for c in opts.completion_lengths:
                batch = make_batch(b, opts.prompt_length, c, rec["vocab_size"], opts.device, opts.seed + b * c)
                for path in PATHS:
                    r = _run_point(trainers[path], model, opt, batch, opts, opts.reps)
                    r = {"path": path, "batch_size": b, "completion_length": c,
                         "tokens": b * (opts.prompt_length + c),
                         "completion_tokens": int(batch["completion_mask"].sum()), **r}
                    rec["steps"].append(r)
                    log(_line(r))
                del batch
        if opts.zero_advantage_fractions:
            rec["skip_parity"], rec["skip_steps"] = run_skip(trainers, model, opt, opts, rec["vocab_size"], log)
    del trainers, opt, model
    _cleanup_all(opts.device)
    rec["model_s"] = time.perf_counter() - t0
    return rec


def _cleanup_all(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _line(r: dict[str, Any]) -> str:
    head = f"  {r['path']:10s} batch {r['batch_size']:3d} x completion {r['completion_length']:6d}"
    if r["status"] != "ok":
        return f"{head}: {r['status']}"
    mem = f", peak {r['peak_bytes'] / 2**30:6.2f} GiB" if "peak_bytes" in r else ""
    return f"{head}: {r['time_ms']:9.1f} ms{mem}, saved for backward {r['saved_bytes'] / 2**20:9.1f} MiB"


def run(opts: E2EOptions, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every model of ``opts`` → their records."""
    return [run_model(name, opts, log) for name in opts.models]
