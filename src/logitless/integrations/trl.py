"""TRL integration: a drop-in ``GRPOTrainer`` whose loss and old/ref log-probs run through
logitless from the model's final hidden states and its head, never asking for logits.

    from logitless.integrations.trl import LogitlessGRPOTrainer as GRPOTrainer

Everything else (generation, rewards, advantages, logging, checkpoints) is TRL's own code.
Matches TRL 1.16 ``GRPOTrainer._compute_loss`` for every option it accepts. What runs through
logitless is set by a :class:`~logitless.integrations.config.LogitlessConfig`; a part logitless
cannot take (an unrecognized head, an option not reproduced yet) runs TRL's own code instead of
computing something different, with a warning when it was asked for explicitly.

Names (TRL's → the core's): ``completion_ids`` → ``targets``, ``old_per_token_logps`` /
``ref_per_token_logps`` → ``old_logp`` / ``ref_logp``, ``compute_entropy`` → ``entropy=``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from trl import GRPOTrainer

from ..model_heads import add_hidden_states_forward, find_head, head_inputs
from ..objectives import PolicyConfig, policy_loss, token_logprobs, vocab_stats
from .config import LogitlessConfig, Switches
from .trl_head import ActiveMetric, UnsupportedConfigError, check_config, discover_heads, finish, lora_head_admitted
from .trl_skip import counted_mask, loss_without_zero_advantage, skip_problem

__all__ = ["FixedCompletions", "LogitlessGRPOTrainer", "UnsupportedConfigError", "patch_grpo_trainer",
           "trl_own_path"]


class _CachedReference(torch.nn.Module):
    """Stands in for the freed reference model: its log-probs come from the trainer's cache."""


def _unsupported(trainer) -> list[str]:
    """The trainer's options that the fused loss does not reproduce (``fused_loss`` resolves off)."""
    args = trainer.args
    out = []
    if getattr(args, "use_adaptive_entropy", False):
        out.append("use_adaptive_entropy=True (adaptive entropy controller)")
    if getattr(trainer, "aux_loss_enabled", False):
        out.append("MoE router aux loss (output_router_logits)")
    if getattr(args, "use_liger_kernel", False):
        out.append("use_liger_kernel=True")
    if _vespo_weight_reads_padding(trainer):
        out.append("loss_type='vespo' with a token-level sampler correction whose clip range excludes 1 (TRL's gamma "
                   "weight then depends on padding; docs/policy-objectives.md)")
    return out


def _vespo_weight_reads_padding(trainer) -> bool:
    """TRL's VESPO weight sums ``log ρ`` over every position; at a padded one ``ρ`` is the clip of
    exp(0) = 1, which is not 1 when the clip range excludes 1, so TRL's loss depends on padding."""
    if getattr(trainer, "loss_type", None) != "vespo" or not (
            getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False)):
        return False
    if not str(getattr(trainer, "vllm_importance_sampling_mode", "")).startswith("token"):
        return False
    lo = getattr(trainer, "vllm_importance_sampling_clip_min", None)
    hi = getattr(trainer, "vllm_importance_sampling_clip_max", None)
    return (lo is not None and lo > 1) or (hi is not None and hi < 1)


class FixedCompletions:
    """GRPO on completions given in advance (offline / replayed rollouts), through TRL 1.16's
    ``rollout_func`` (experimental in TRL): the trainer scores and trains on these completions
    instead of sampling, so their reference log-probs can come from a cache built beforehand.

        fixed = FixedCompletions({"t1 t2": ["t5 t6", "t7", ...], ...}, tokenizer)
        build(ref_model, fixed.records(), "ref-cache", tokenizer=tokenizer)
        LogitlessGRPOTrainer(..., rollout_func=fixed, ref_cache="ref-cache")

    Args:
        completions: prompt text → its completion texts (``num_generations`` of them, or any
            number: group member ``i`` of a prompt gets completion ``i mod len``). Text prompts
            only (conversational prompts need your own ``rollout_func``).
        tokenizer: the trainer's tokenizer. Prompts are tokenized as TRL tokenizes text
            prompts (``tokenizer(text=...)``); completions without special tokens, followed by
            ``eos_token_id`` (as a sampled completion that stopped).

    Raises:
        TypeError: a prompt that is not a string.
        ValueError: a prompt without completions, or that (or a completion) tokenizes to no
            tokens; at call, a prompt not in ``completions``.
    """

    def __init__(self, completions: Mapping[str, Sequence[str]], tokenizer: Any) -> None:
        for prompt, texts in completions.items():
            if not isinstance(prompt, str):
                raise TypeError(f"FixedCompletions takes text prompts, got {type(prompt).__name__}")
            if isinstance(texts, str) or not texts:
                raise ValueError(f"prompt {prompt!r}: completions must be a non-empty list of strings")
        self.tokenizer = tokenizer
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self._ids = {p: (tokenizer(text=[p])["input_ids"][0],
                         [tokenizer(text=t, add_special_tokens=False)["input_ids"] + eos for t in texts])
                     for p, texts in completions.items()}
        for p, (ids, outs) in self._ids.items():
            if not ids or not all(outs):
                raise ValueError(f"prompt {p!r} or one of its completions tokenizes to no tokens")

    def __call__(self, prompts: list, trainer: Any = None) -> dict[str, Any]:
        """TRL's ``rollout_func(prompts, trainer)``: ``prompt_ids``, ``completion_ids`` (lists of
        token ids) and ``logprobs=None`` (no sampler: TRL computes the old log-probs itself)."""
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for p in prompts:
            if not isinstance(p, str) or p not in self._ids:
                raise ValueError(f"FixedCompletions has no completions for prompt {p!r}")
            ids, outs = self._ids[p]
            i = seen[p] = seen.get(p, -1) + 1
            prompt_ids.append(list(ids))
            completion_ids.append(list(outs[i % len(outs)]))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def records(self) -> list[dict[str, list[int]]]:
        """Every (prompt, completion) as a :func:`logitless.refcache.build` record
        (``prompt_ids``, ``completion_ids``): the sequences the trainer will ask for."""
        return [{"prompt_ids": list(ids), "completion_ids": list(c)} for ids, outs in self._ids.values() for c in outs]


class LogitlessGRPOTrainer(ActiveMetric, GRPOTrainer):
    """``trl.GRPOTrainer`` with the head computed by logitless.

    Extra keyword arguments (all optional):
        logitless_config: :class:`LogitlessConfig` (what runs through logitless: the training
            loss, the log-probs, fp32 logits; mode, backend, workspace). Default: everything
            that can, in fp32; resolved at construction into ``trainer.logitless``
            (:class:`~logitless.integrations.config.Switches`).
        ref_cache: a :class:`logitless.refcache.RefCache` (or its directory) of the reference
            model's log-probs (``beta > 0``): reference log-probs are served from it and the
            reference model TRL loaded is freed. Opened against the policy's initial weights,
            tokenizer and temperature (a mismatch is refused). Only for completions fixed in
            advance, i.e. a ``rollout_func`` that returns them (:class:`FixedCompletions`):
            sampled completions are never in a cache built beforehand, so a trainer that
            generates them refuses ``ref_cache`` at construction.

    A LoRA adapter on ``lm_head`` (``peft_config`` with ``lm_head`` in ``target_modules``, or a
    PEFT model), which TRL's own trainer refuses (its head would ignore the adapter), is
    accepted; the adapter's term is computed inside the pass.

    Raises:
        UnsupportedConfigError: ``ref_cache`` with ``beta == 0``, ``sync_ref_model``, or
            completions the trainer generates (no ``rollout_func``, or tools / environments);
            a LoRA adapter on the head with ``fused_loss`` or ``fused_logprobs`` off.
        TypeError, ValueError: an invalid :class:`LogitlessConfig`.
    """

    def __init__(self, *args: Any, logitless_config: LogitlessConfig | None = None, ref_cache: Any = None,
                 **kwargs: Any) -> None:
        if ref_cache is not None:  # before TRL loads a reference model
            _check_ref_cache_applies(inspect.signature(GRPOTrainer.__init__).bind_partial(None, *args, **kwargs))
        with lora_head_admitted(GRPOTrainer, args, kwargs):
            super().__init__(*args, **kwargs)
        _attach(self, logitless_config)
        self.logitless_ref_cache = None
        if ref_cache is not None:
            self._use_ref_cache(ref_cache)

    def _use_ref_cache(self, ref_cache: Any) -> None:
        from ..refcache import RefCache, free_reference

        if not isinstance(ref_cache, RefCache):
            ref_cache = RefCache.open(ref_cache, model=self.accelerator.unwrap_model(self.model),
                                      tokenizer=self.processing_class, temperature=self.temperature)
        self.logitless_ref_cache = ref_cache
        if self.ref_model is not None:
            free_reference(self.ref_model)
        # TRL only tests `ref_model is not None` and passes it back to the method below.
        self.ref_model = _CachedReference()

    # ---- rollout side: old / reference log-probs ------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        if isinstance(model, _CachedReference):
            k = logits_to_keep
            logps = self.logitless_ref_cache.ref_logps_for(input_ids[:, :-k], attention_mask[:, :-k],
                                                          input_ids[:, -k:], attention_mask[:, -k:])
            return logps, None, None
        sw = self.logitless
        given = [k for k, v in extra.items() if v is not None] + (["compute_aux_loss"] if compute_aux_loss else [])
        if given or not sw.fused_logprobs:
            if given and sw.config.fused_logprobs:
                sw.warn_once("fused_logprobs", f"multimodal / aux-loss inputs {given}")
            return GRPOTrainer._get_per_token_logps_and_entropies(
                self, model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)
        batch_size = batch_size or input_ids.size(0)
        logps, ents = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start:start + batch_size]
            am = attention_mask[start:start + batch_size]
            hidden, head = self._head_pass(model, ids, am, logits_to_keep)
            targets = ids[:, -logits_to_keep:].masked_fill(am[:, -logits_to_keep:] == 0, -100)
            if torch.is_grad_enabled():
                st = vocab_stats(hidden, head, targets, entropy=compute_entropy, options=sw.options)
                lp, en = st.logp, st.entropy
            else:
                out = token_logprobs(hidden, head, targets, entropy=compute_entropy, options=sw.options)
                lp, en = out if compute_entropy else (out, None)
            logps.append(lp)
            if compute_entropy:
                ents.append(en)
        return torch.cat(logps), torch.cat(ents) if compute_entropy else None, None

    def _head_pass(self, model, input_ids, attention_mask, logits_to_keep):
        """Final hidden states of the completion positions and the :class:`logitless.Head` at the
        trainer's temperature, in one dtype."""
        with self.accelerator.autocast():
            hidden = model(input_ids=input_ids, attention_mask=attention_mask, logitless_hidden_states=True)
        hidden = hidden[:, -logits_to_keep - 1:-1]
        head = find_head(self.accelerator.unwrap_model(model))
        # head_inputs: the autocast dtype, and the unsharded weight under FSDP2.
        if getattr(self.args, "cast_lm_head_to_fp32", False):
            hidden, ready = head_inputs(hidden, head)  # outside autocast: no rounding first
            hidden = hidden.float()
            ready = dataclasses.replace(ready, weight=ready.weight.float(),
                                        bias=None if ready.bias is None else ready.bias.float())
        else:
            with self.accelerator.autocast():
                hidden, ready = head_inputs(hidden, head)
        return hidden, ready.at_temperature(self.temperature)

    # ---- training loss --------------------------------------------------------------------
    def policy_config(self) -> PolicyConfig:
        """This trainer's options as a :class:`logitless.PolicyConfig`."""
        a = self.args
        return PolicyConfig(
            loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
            epsilon=self.epsilon_low, epsilon_high=self.epsilon_high, delta=a.delta, beta=self.beta,
            use_bias_correction_kl=a.use_bias_correction_kl, sapo_temperature_pos=a.sapo_temperature_pos,
            sapo_temperature_neg=a.sapo_temperature_neg, vespo_k_pos=a.vespo_k_pos,
            vespo_lambda_pos=a.vespo_lambda_pos, vespo_k_neg=a.vespo_k_neg, vespo_lambda_neg=a.vespo_lambda_neg,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            top_entropy_quantile=self.top_entropy_quantile, entropy_coef=self.entropy_coef,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps,
            num_processes=self.accelerator.num_processes, steps_per_generation=a.steps_per_generation,
            max_completion_length=self.max_completion_length, training=self.model.training)

    def _compute_loss(self, model, inputs):
        sw = self.logitless
        if not sw.fused_loss:
            return GRPOTrainer._compute_loss(self, model, inputs)
        if sw.config.skip_zero_advantage and self.model.training:
            return loss_without_zero_advantage(self, model, inputs, self._fused_loss)
        mask = counted_mask(inputs)
        if mask.size(1) == 1 and not bool(mask.all()):
            # At completion length 1 TRL's metric helpers average padded positions into entropy, kl and
            # the clip ratios (docs/policy-objectives.md); logitless never sees padding. The logits are
            # [B, 1, V] here, so TRL's own path (its head too) costs nothing and gives TRL's numbers.
            sw.warn_once("fused_loss", "completion length 1 with padded positions: TRL's metrics average the "
                                       "padding in")
            with trl_own_path(self):
                return GRPOTrainer._compute_loss(self, model, inputs)
        return self._fused_loss(model, inputs)

    def _fused_loss(self, model, inputs):
        """The training loss of TRL's micro-batch ``inputs`` through ``logitless.policy_loss``;
        logs TRL's metrics."""
        sw = self.logitless
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        t = inputs["completion_ids"].size(1)
        hidden, head = self._head_pass(model, ids, am, t)
        use_is = self.use_vllm and self.vllm_importance_sampling_correction
        group = dist.group.WORLD if self.accelerator.num_processes > 1 else None
        loss, metrics = policy_loss(
            hidden, head, inputs["completion_ids"], inputs["completion_mask"], inputs["advantages"],
            inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps"), config=self.policy_config(),
            num_items_in_batch=inputs.get("num_items_in_batch"), tool_mask=inputs.get("tool_mask"),
            sampling_logp=inputs.get("sampling_per_token_logps"),
            importance_sampling_ratio=inputs.get("importance_sampling_ratio") if use_is else None,
            group=group, options=sw.options)
        mode = "train" if self.model.training else "eval"
        for k, v in metrics.items():
            if not k.startswith("entropy_bonus/"):  # inputs of the adaptive controller, which TRL does not log
                self._metrics[mode][k].append(v.item())
        if self.entropy_coef != 0.0 and mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)  # as TRL logs it, per optimizer step
        return loss


def _check_ref_cache_applies(call: inspect.BoundArguments) -> None:
    """Refuse ``ref_cache`` for a ``GRPOTrainer(...)`` call whose reference cannot come from a cache
    built beforehand (see :class:`LogitlessGRPOTrainer`)."""
    a = call.arguments
    args = a.get("args")
    if getattr(args, "beta", 0.0) == 0.0:
        raise UnsupportedConfigError("ref_cache is only used with beta != 0 (the KL to the reference)")
    if getattr(args, "sync_ref_model", False):
        raise UnsupportedConfigError("ref_cache holds a fixed reference; sync_ref_model=True moves it")
    generated = []
    if a.get("rollout_func") is None:
        generated.append("no rollout_func: TRL samples the completions")
    if a.get("tools") or a.get("environment_factory") is not None:
        generated.append("tools / environment_factory: the tool loop generates completion tokens")
    if generated:
        raise UnsupportedConfigError(
            "ref_cache needs completions known before training, but this trainer generates them ("
            + "; ".join(generated) + "), so no cache built beforehand holds them and the first step would stop "
            "with RefCacheMissError. Without a ref_cache the reference model runs (through logitless). For a "
            "fixed-completion dataset pass rollout_func=FixedCompletions(...) and build the cache from its "
            "records() (docs/refcache.md, Recipes)")


def patch_grpo_trainer(trainer: GRPOTrainer, logitless_config: LogitlessConfig | None = None) -> LogitlessGRPOTrainer:
    """Turn an existing ``GRPOTrainer`` into a :class:`LogitlessGRPOTrainer` in place (same
    state, logitless head), configured by ``logitless_config``.

    Raises:
        TypeError, ValueError: an invalid :class:`LogitlessConfig`.
        UnsupportedConfigError: a LoRA adapter on the head with ``fused_loss`` or ``fused_logprobs`` off.
    """
    _attach(trainer, logitless_config)
    trainer.__class__ = LogitlessGRPOTrainer
    return trainer


def _attach(trainer: GRPOTrainer, config: LogitlessConfig | None) -> None:
    config = check_config(config)
    models = [m for m in (trainer.model, trainer.ref_model) if m is not None and not isinstance(m, _CachedReference)]
    head_problem, lora_head = discover_heads(models, config)
    trainer.logitless = Switches.resolve(config, head_problem, _unsupported(trainer))
    if lora_head and not (trainer.logitless.fused_loss and trainer.logitless.fused_logprobs):
        why = "; ".join(f"{k}: {v}" for k, v in trainer.logitless.why_not.items())
        raise UnsupportedConfigError(f"the model has a LoRA adapter on lm_head, which TRL's own head ignores; it "
                                     f"needs fused_loss and fused_logprobs on ({why})")
    if trainer.logitless.fused_loss or trainer.logitless.fused_logprobs:
        for m in models:
            add_hidden_states_forward(m)
    if config.skip_zero_advantage and (why := skip_problem(trainer)) is not None:
        trainer.logitless.warn_once("skip_zero_advantage", why + "; every completion runs")
    finish(trainer, trainer.logitless)


@contextlib.contextmanager
def trl_own_path(trainer: LogitlessGRPOTrainer) -> Iterator[GRPOTrainer]:
    """Within the block, ``trainer`` computes its loss and log-probs with TRL's own code (its
    chunked head and ``_compute_loss``), for A/B checks against logitless on the same state."""
    trainer._compute_loss = types.MethodType(GRPOTrainer._compute_loss, trainer)
    trainer._get_per_token_logps_and_entropies = types.MethodType(
        GRPOTrainer._get_per_token_logps_and_entropies, trainer)
    try:
        yield trainer
    finally:
        del trainer._compute_loss
        del trainer._get_per_token_logps_and_entropies
