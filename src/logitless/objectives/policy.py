"""``policy_loss``: the PPO/GRPO family straight from hidden states and the head weight."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..amp import autocast_head_inputs
from ..distributed import all_reduce, gather_varlen
from ..ops import (
    ChunkStats,
    Head,
    ObjectiveSpec,
    PassOptions,
    StatRequest,
    ValueChecks,
    ZeroRows,
    as_head,
    as_options,
    check_count,
    check_devices,
    check_head_inputs,
    check_mask,
    defers_checks,
    run_objective,
    start_pass,
    stat_dtype_for,
)
from . import compiled
from .config import CLIPPED, PolicyConfig
from .layout import TokenLayout, counted_first_order
from .policy_terms import LOG_1E8, LazyTokens, PolicyTokens, chunk_terms, sequence_metrics, vespo_phi


def _want(cfg: PolicyConfig) -> StatRequest:
    """The policy pass's statistics (the entropy for the metrics); without an entropy bonus the
    loss reaches the logits through ``logp`` alone."""
    return StatRequest(entropy=True, logp_grad_only=cfg.entropy_coef == 0.0)


@dataclass(frozen=True)
class _Prepared:
    """A validated :func:`policy_loss` call: the counted tokens' layout, the pass's objective spec
    (without ``before_loss``), the hidden rows ``[n, H]`` and int64 ids ``[n]`` that enter the pass, and its
    per-token tensors (built at the first chunk's objective)."""

    layout: TokenLayout
    spec: ObjectiveSpec  # with the rows whose gradient is zero and the first rows' started statistics GEMM
    hidden: torch.Tensor
    targets: torch.Tensor
    tokens: LazyTokens
    checks: ValueChecks | None  # the value checks read at the end of the call, or None: read with the counts


@dataclass(frozen=True)
class _PolicyInputs:
    """The per-token tensors of one :func:`policy_loss` call, as given."""

    targets: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    tool_mask: torch.Tensor | None
    sampling_logp: torch.Tensor | None
    importance_sampling_ratio: torch.Tensor | None
    segment_ids: torch.Tensor | None


@autocast_head_inputs(compiled=compiled.route(compiled.policy_loss))
def policy_loss(
    hidden: torch.Tensor,  # [B, T, H] padded, or [N, H] packed
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [B, T] or [N]
    completion_mask: torch.Tensor,  # [B, T] or [N]
    advantages: torch.Tensor,  # [B] (per sequence) or [B, T]
    old_logp: torch.Tensor | None = None,  # [B, T]
    ref_logp: torch.Tensor | None = None,  # [B, T]
    *,
    config: PolicyConfig | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    tool_mask: torch.Tensor | None = None,  # [B, T]
    sampling_logp: torch.Tensor | None = None,  # [B, T]
    importance_sampling_ratio: torch.Tensor | None = None,  # [B, T] or [B, 1]
    segment_ids: torch.Tensor | None = None,  # [N] for packed inputs
    sequence_group=None,
    group=None,
    options: PassOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss (GRPO family) and TRL's metrics from one vocabulary pass.

    Semantics are TRL 1.16 ``GRPOTrainer._compute_loss`` (``docs/policy-objectives.md``):
    ``r = logp - old_logp`` (``old_logp=None`` → ``logp.detach()``), the ratio at
    ``config.importance_sampling_level``, the loss type's surrogate, masks and sampler
    correction, ``+ beta · k3 KL`` (``exp(ref - logp) - (ref - logp) - 1``), the loss type's
    normalizer, minus the entropy bonus. Log-probs and entropies are of the temperature-scaled
    softmax (the head's ``transform``), in fp32 (fp64 for fp64 inputs), nats.

    Args:
        hidden: final hidden states that predict the completion tokens, ``[B, T, H]``
            (padded) or ``[N, H]`` with ``segment_ids`` (packed).
        head: :class:`logitless.Head` (weight ``[V, H]`` of ``hidden``'s dtype and device, bias,
            :class:`LogitTransform` with the sampling temperature, LoRA adapter — gradients
            reach its ``a``/``b``, and a frozen weight skips its ``d weight`` GEMM — and
            vocabulary shard), or a bare ``[V, H]`` weight.
        targets: the completion token ids (TRL's ``completion_ids``), integer ``[B, T]`` /
            ``[N]``, each in ``[0, V)``; only counted ones are read.
        completion_mask: ``[B, T]`` / ``[N]``, 1 for counted tokens (multiplied by
            ``tool_mask``); masked tokens never reach the vocabulary pass. Bool, integer or
            floating; values finite and >= 0 (a value is the token's weight).
        advantages: ``[B]`` (per sequence; ``[S]`` packed) or per token.
        old_logp, ref_logp, sampling_logp: per-token log-probs of the old policy, the
            reference (needed iff ``beta != 0``) and the sampler (off-policy mask).
        config: :class:`PolicyConfig` (TRL names; default TRL's defaults, ``dapo``).
        num_items_in_batch: TRL's token count of the whole generation batch (dapo, cispo,
            vespo, reinforce): a number or a one-element tensor, finite and > 0 (0 only when this
            call counts no token: TRL clamps it to 1), read with the other value checks;
            ``None`` → this call's counted tokens.
        importance_sampling_ratio: sampler correction ``ρ`` (see
            :func:`logitless.sampling_correction`), multiplied into the per-token loss.
        segment_ids: packed layout: non-decreasing ``[N]`` sequence index per token.
        sequence_group: sequence/context-parallel process group whose ranks hold pieces of the
            same packed sequences (``segment_ids`` global); sequence-level quantities (GSPO
            ratio, per-sequence means, off-policy KL, VESPO weight) and token counts are then
            summed over it, and each rank's loss is its share: their sum is the loss of the
            whole sequences. Objectives that need whole sequences then run in recompute mode.
        group: data-parallel ``torch.distributed`` process group (ranks holding different
            sequences) over which metrics are reduced (sums and counts, min/max) and the entropy
            quantile is taken, as TRL does across processes; ``None``: this process only. The loss itself stays
            local (its normalizers are TRL's: ``num_items_in_batch`` and ``num_processes``).
        options: :class:`logitless.PassOptions`: ``mode`` ``"fused"`` (gradient computed in the
            forward, 3 GEMMs of work), ``"recompute"`` (O(N) saved state, 4 GEMMs) or ``"auto"``
            (fused unless the objective needs all entropies first: ``top_entropy_quantile < 1``),
            backend, workspace budget, logits precision.

    Returns:
        ``(loss, metrics)``: scalar loss (differentiable w.r.t. ``hidden``, ``weight``,
        ``bias``) and a dict of 0-dim tensors named as TRL logs them (``kl``, ``entropy``,
        ``clip_ratio/low_mean`` … ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, ``policy_loss``
        with an entropy bonus), reduced over ``group``. With ``entropy_coef != 0`` also
        ``entropy_bonus/entropy_sum`` and ``entropy_bonus/token_count``: this call's Σ H·m' and
        Σ m' over the bonus's tokens (not reduced), the inputs of TRL's adaptive entropy
        controller (``entropy_target``, ``entropy_coef_delta``, ...), which keeps a window sum
        and reduces it at the optimizer step.

    Raises:
        TypeError, ValueError: shapes, dtypes (integer log-probs or ratios), devices (meta
            included, each input named), token ids out of range, NaN/inf in inputs that reach
            the loss, a mask value that is negative or not finite (any dtype), a bad
            ``num_items_in_batch``, logits beyond what the statistics hold, missing ``ref_logp``
            with ``beta``, invalid option combinations.
    """
    cfg = _as_config(config)
    head, options = as_head(head), as_options(options)
    if sequence_group is not None and segment_ids is None:
        raise ValueError("sequence_group needs packed inputs with global segment_ids")
    inputs = _PolicyInputs(targets, completion_mask, advantages, old_logp, ref_logp, tool_mask, sampling_logp,
                           importance_sampling_ratio, segment_ids)
    prep = _prepare(hidden, head, inputs, cfg, num_items_in_batch, sequence_group, options)
    if prep.layout.distributed:  # its normalizers take collectives: every rank makes them here, in order
        prep.tokens.get()

    def set_entropy_mask(stats: ChunkStats) -> None:
        tok = prep.tokens.get()
        tok.entropy_mask = _entropy_mask(stats.entropy, cfg.top_entropy_quantile, group, sequence_group)
        if tok.bonus_weight is not None:
            denom = all_reduce((tok.m * tok.entropy_mask).sum(), "sum", sequence_group).clamp(min=1.0)
            tok.bonus_weight = tok.m / denom / _accum(cfg)

    spec = dataclasses.replace(prep.spec, before_loss=set_entropy_mask) if cfg.needs_global_entropy else prep.spec
    # The pass computes the loss only; the metrics are taken afterwards, once, from every token's
    # (detached) statistics: per-chunk metric kernels made the fused pass launch-bound on GPUs.
    loss, stats, _ = run_objective(prep.hidden, head, prep.targets, prep.tokens.loss_term, spec, options)
    tok = prep.tokens.get()
    with torch.no_grad():
        _, sums = chunk_terms(cfg, tok, slice(None), stats.logp, stats.entropy)  # every token
        metrics = _finalize_metrics(cfg, tok, sums, group)
        if tok.sampling_logp is not None:
            metrics.update(sampler_mismatch(stats.logp, tok.sampling_logp, group))
    if prep.checks is not None:  # the value checks queued behind the pass: read once it is all queued
        prep.checks.read()
    return loss, metrics


def _zero_gradient_rows(cfg: PolicyConfig, lay: TokenLayout, advantages: torch.Tensor,
                        counted: torch.Tensor | None = None) -> torch.Tensor | None:
    """``[n]`` bool over the tokens of ``lay``, those whose gradient is exactly zero whatever the
    pass computes: without a KL term or an entropy bonus every loss type's term is its advantage
    (``advantages``, per token) times a factor, so a token of zero advantage has none; at
    sequence level (not GSPO-token's, whose sequence ratio is detached) a token's log-ratio also
    reaches its sequence's ratio, so only the tokens of sequences with zero advantage throughout
    (over the sequence-parallel group). ``counted``: ``[n]`` bool, the tokens of ``lay`` that count
    (the others are marked too, and none of their advantages is read). ``None`` where no token can
    be known to have none."""
    if cfg.beta != 0.0 or cfg.entropy_coef != 0.0:
        return None
    zero = advantages == 0
    if counted is not None:
        zero = zero | ~counted
    if cfg.importance_sampling_level == "sequence":
        zero = (lay.seq_sum((~zero).to(lay.weight.dtype)) == 0)[lay.seg]
        if counted is not None:
            zero = zero | ~counted
    return zero


def _gradient_first(cfg: PolicyConfig, advantages: torch.Tensor, mask: torch.Tensor, options: PassOptions,
                    head: Head, sdt: torch.dtype) -> torch.Tensor | None:
    """``[B, T]`` or ``[B, 1]`` bool, the positions that may have a gradient, for
    :meth:`TokenLayout.counted_first` to put first, where a fused pass skips the rows
    :func:`_zero_gradient_rows` marks: the pass then plans its gradient chunks over those rows
    alone (``ZeroRows.leading``) and only computes the others' statistics. At token level the
    tokens of non-zero advantage; at sequence level (GSPO) the sequences with one at a counted
    token, whole (a sequence-level objective's chunks hold whole sequences). ``None`` where it
    would not: tokens of zero advantage inside a sequence whose chunks must stay whole
    (GSPO-token, the off-policy mask, VESPO at token level), or an advantage shape the layout will
    refuse. The advantages are compared in the statistics dtype ``sdt``, as
    :func:`_zero_gradient_rows` compares them: the rows it marks are then exactly those not put
    first."""
    per_sequence = cfg.importance_sampling_level == "sequence"
    if (cfg.beta != 0.0 or cfg.entropy_coef != 0.0 or cfg.needs_global_entropy or options.mode == "recompute"
            or (cfg.needs_whole_sequences and not per_sequence) or not options.skip_zero_rows
            or head.lora is not None):
        return None
    b = mask.shape[0]
    if advantages.dim() == 1 and advantages.shape[0] == b:
        advantages = advantages[:, None]
    if advantages.shape not in ((b, 1), mask.shape):
        return None
    lead = advantages.to(sdt) != 0
    return ((mask != 0) & lead).any(1, keepdim=True) if per_sequence else lead


def sampler_mismatch(logp: torch.Tensor, sampling_logp: torch.Tensor, group=None) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs are from the sampler's, over the tokens the sampler scored.

    The trainer-sampler mismatch RL practitioners track (vLLM ``head_dtype=float32``, SGLang
    ``enable_fp32_lm_head``): with ``d = logp - sampling_logp`` (NaN sampler entries skipped, as TRL
    skips them), ``sampling/trainer_sampler_logp_difference/{mean,max}`` are ``mean/max |d|``
    (nats) and ``sampling/trainer_sampler_ratio_error/{mean,max}`` are ``mean/max |exp(d) - 1|``,
    the token-level probability-ratio error ``|p_trainer / p_sampler - 1|``. Means are reduced
    as (sum, count) and maxima as maxima over ``group``.

    Args:
        logp, sampling_logp: ``[n]`` log-probs (nats) of the same tokens; ``sampling_logp`` may
            hold NaN.
        group: data-parallel process group, or ``None``.

    Returns:
        The four metrics as 0-dim tensors (0 when no token was scored).
    """
    d = logp.detach() - sampling_logp
    ok = ~torch.isnan(d)
    gap = torch.where(ok, d.abs(), 0.0)
    err = torch.where(ok, torch.expm1(d).abs(), 0.0)
    sums = all_reduce(torch.stack([gap.sum(), err.sum(), ok.sum().to(gap.dtype)]), "sum", group)
    maxima = all_reduce(torch.stack([gap.max(), err.max()]) if gap.numel() else gap.new_zeros(2), "max", group)
    count = sums[2].clamp(min=1.0)
    return {"sampling/trainer_sampler_logp_difference/mean": sums[0] / count,
            "sampling/trainer_sampler_logp_difference/max": maxima[0],
            "sampling/trainer_sampler_ratio_error/mean": sums[1] / count,
            "sampling/trainer_sampler_ratio_error/max": maxima[1]}


_TRL_DEFAULTS = PolicyConfig()


def _as_config(config) -> PolicyConfig:
    if config is None:
        return _TRL_DEFAULTS
    if not isinstance(config, PolicyConfig):
        raise TypeError(f"config must be a logitless.PolicyConfig, got {type(config).__name__}"
                        + (": build it with PolicyConfig(**your_dict)" if isinstance(config, dict) else ""))
    return config


def _accum(cfg: PolicyConfig) -> float:
    return float(cfg.gradient_accumulation_steps) if cfg.training else 1.0


def _entropy_mask(entropy: torch.Tensor, quantile: float, group, sequence_group=None) -> torch.Tensor:
    """TRL's ``get_high_entropy_mask`` on the counted tokens: the quantile of the entropies of
    all processes' counted tokens, in fp32 as TRL takes it."""
    gathered = gather_varlen(gather_varlen(entropy.float(), sequence_group), group)
    if gathered.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    threshold = torch.quantile(gathered, 1 - quantile)
    return entropy >= threshold


def _prepare(hidden: torch.Tensor, head: Head, inputs: _PolicyInputs, cfg: PolicyConfig, num_items_in_batch,
             sequence_group, options: PassOptions) -> _Prepared:
    """Validate the inputs and gather the counted tokens' rows and ids."""
    targets, completion_mask, advantages = inputs.targets, inputs.completion_mask, inputs.advantages
    old_logp, ref_logp, sampling_logp = inputs.old_logp, inputs.ref_logp, inputs.sampling_logp
    tool_mask, importance_sampling_ratio, segment_ids = inputs.tool_mask, inputs.importance_sampling_ratio, \
        inputs.segment_ids
    if not isinstance(hidden, torch.Tensor) or not isinstance(completion_mask, torch.Tensor):
        raise TypeError("hidden and completion_mask must be torch.Tensors")
    packed = segment_ids is not None
    want = 2 if packed else 3
    if hidden.dim() != want:
        raise ValueError(f"hidden must be {'[N, H] with segment_ids' if packed else '[B, T, H]'}, got shape "
                         f"{tuple(hidden.shape)}")
    lead = hidden.shape[:-1]
    per_token = {"targets": targets, "completion_mask": completion_mask, "tool_mask": tool_mask,
                 "old_logp": old_logp, "ref_logp": ref_logp, "sampling_logp": sampling_logp,
                 "segment_ids": segment_ids}
    for name, x in per_token.items():
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape != lead):
            raise ValueError(f"{name} must have shape {tuple(lead)}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if cfg.beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={cfg.beta} needs ref_logp (the reference model's per-token log-probs)")
    for name, x in (("advantages", advantages), ("importance_sampling_ratio", importance_sampling_ratio)):
        if (x is not None or name == "advantages") and not isinstance(x, torch.Tensor):  # advantages is required
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check_devices(hidden.device, {"hidden": hidden, **per_token, "advantages": advantages,
                                  "importance_sampling_ratio": importance_sampling_ratio})
    if advantages.dtype == torch.bool or advantages.is_complex():
        raise TypeError(f"advantages must be a real (floating or integer) tensor, got {advantages.dtype}")
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("sampling_logp", sampling_logp),
                    ("importance_sampling_ratio", importance_sampling_ratio)):
        if x is not None and not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor (log-probs in nats, ratios), got {x.dtype}")
    if importance_sampling_ratio is not None and cfg.loss_type == "vespo" \
            and importance_sampling_ratio.shape != lead:
        raise ValueError("vespo needs a per-token importance_sampling_ratio (token_truncate / token_mask "
                         "modes), as TRL requires")

    # One host synchronization reads the counts the pass needs: how many tokens count (padded
    # inputs), the rows with a gradient, and where each sequence's counted tokens end (the chunk
    # cuts of a sequence-level objective). The value checks of the masks, the head's inputs and
    # the per-token inputs see every position of the caller's layout and check the counted ones.
    # Where the pass may run on unchecked values (defers_checks), their reductions are queued
    # behind its first statistics GEMM (while the host waits for the counts where that GEMM
    # started before the read, else at the first chunk's objective) and read when the whole call
    # is queued, so the host prepares them while the GPU computes; elsewhere they come with the
    # counts, in the same synchronization.
    request = _want(cfg)
    defer = not packed and defers_checks(options.impl, hidden, head.lora is not None, request)
    checks = ValueChecks()
    check_mask(completion_mask, "completion_mask", checks, hidden.device, binary=False)
    if tool_mask is not None:
        check_mask(tool_mask, "tool_mask", checks, hidden.device, binary=False)
    mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    if mask.dtype == torch.bool:
        mask = mask.to(torch.int64)
    sdt = stat_dtype_for(hidden.dtype)
    if packed:  # the segment count is read first (a synchronization of its own)
        seen = TokenLayout.from_segments(mask, segment_ids, sequence_group)
        count = counted = in_place = leading = None
        index = seen.index
        check_head_inputs(seen.rows(hidden), head, seen.gather(targets), ignore_index=None, checks=checks)
    else:  # every position, the counted ones first; the hidden rows and ids checked in place
        leading = _gradient_first(cfg, advantages, mask, options, head, sdt)
        in_place = mask != 0
        check_head_inputs(hidden.reshape(-1, hidden.shape[-1]), head, targets.reshape(-1), ignore_index=None,
                          checks=checks, counted=in_place.reshape(-1))
        index, count = counted_first_order(in_place, leading)
    # The first statistics GEMM runs while the host builds the layout, gathers the per-token inputs
    # and sends the counts, a second while it waits for their read and prepares the pass
    # (start_pass): it needs only the rows' order. Where the rows with a gradient come first, their
    # count sizes the first chunk: it starts after the read.
    # Only a packed layout spans a sequence-parallel group (a counted-first one is never
    # distributed, and is built below, after the start).
    split_sequences = packed and seen.distributed and cfg.needs_whole_sequences
    fused = options.mode != "recompute" and not (cfg.needs_global_entropy or split_sequences)
    first = None if leading is not None else start_pass(hidden, targets, index, head, ObjectiveSpec(request),
                                                        options, fused)
    if not packed:
        seen = TokenLayout.counted_first(mask, index)
        counted = seen.weight != 0  # (in seen's order)

    def bad_values(name: str):
        return lambda: ValueError(f"{name} contains NaN or inf (or a negative ratio) at counted tokens")

    adv_seen = seen.per_token(advantages, "advantages").to(sdt)
    is_seen = None
    if importance_sampling_ratio is not None:
        is_seen = seen.per_token(importance_sampling_ratio, "importance_sampling_ratio").to(sdt)
    if num_items_in_batch is not None:
        # TRL clamps the count to 1: 0 is its count of a generation batch with no counted token.
        num_items_in_batch = check_count(num_items_in_batch, checks, hidden.device,
                                         zero_ok=seen.n == 0 if count is None else count)
    if cfg.loss_type == "dr_grpo" and cfg.max_completion_length is None and packed:
        raise ValueError("dr_grpo on packed inputs needs config.max_completion_length")
    seen_logps = {}

    def add_values() -> None:  # the per-token inputs' checks; also gathers the log-probs tokens() reads
        checks.add_finite(adv_seen, bad_values("advantages"), where=counted)
        if is_seen is not None:
            checks.add_range(is_seen, 0.0, math.inf, bad_values("importance_sampling_ratio"), where=counted)
        for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("sampling_logp", sampling_logp)):
            if x is not None:
                seen_logps[name] = seen.gather(x).to(sdt)
                if name != "sampling_logp":  # TRL maps the sampler's NaN (unscored tokens) to zero evidence
                    checks.add_finite(seen_logps[name], bad_values(name), where=counted)

    checks.later(add_values)
    zero = _zero_gradient_rows(cfg, seen, adv_seen, counted)
    ends = None
    if count is not None and cfg.needs_whole_sequences:
        counts = in_place.sum(1)
        if leading is not None:  # whole sequences, those with a gradient first
            counts = counts[counted_first_order(leading.view(-1))[0]]
        ends = torch.cumsum(counts, 0)
    # The rows with a gradient come as a running count over the rows (a few bytes a token), so a
    # pass of several chunks counts each chunk's on the host.
    reads = [] if count is None else [count]
    before = None if zero is None else torch.cumsum(~zero, 0)
    pending = (ValueChecks() if defer else checks).send(before, *reads, *(() if ends is None else ends.unbind()))
    started = first and start_pass(hidden, targets, index, head, ObjectiveSpec(request), options, fused,
                                   after=first)
    if defer and first is not None:
        # Where the pass's first rows run before the read, the host builds the value checks while
        # it waits for it, not at the first chunk's objective: a first chunk that the started rows
        # cover launches nothing more, and its objective's small kernels would wait for that work.
        checks.queue()
    read, before = pending.wait()
    n = seen.n if count is None else int(read[0])
    with_grad = None if zero is None else (int(before[n - 1]) if n else 0)
    lay = seen if count is None else seen.first(n, None if ends is None else read[len(reads):],
                                                in_order=leading is None or with_grad in (0, n))
    zero_rows = None if zero is None else ZeroRows(zero[:n], with_grad, before[:n], leading=leading is not None)
    spec = ObjectiveSpec(want=request, cuts=lay.cuts if cfg.needs_whole_sequences else None,
                         needs_all_stats=cfg.needs_global_entropy or split_sequences, zero_rows=zero_rows)
    pass_hidden, pass_ids = lay.rows(hidden), lay.gather(targets).long()
    if leading is not None:  # the host prepares the rest of the pass while these rows' GEMM runs
        started = start_pass(pass_hidden, pass_ids, None, head, spec, options, fused)

    def tokens() -> PolicyTokens:
        """The per-token tensors and TRL's normalizers of ``lay``'s tokens, built at the first
        chunk's objective: the host prepares them while the first statistics GEMM runs."""
        if defer:  # behind the first statistics GEMM (queued already where rows started before the read)
            checks.queue()
        lay.weight = m = lay.weight.to(sdt)
        lay.seg_len = lay.seg_len.to(sdt)
        n_seq = lay.num_segments
        m_total = all_reduce(m.sum(), "sum", sequence_group) if lay.distributed else m.sum()
        g = _accum(cfg)
        lt = cfg.loss_type
        if lt in ("grpo", "sapo"):
            loss_weight = m / lay.seg_len.clamp(min=1.0)[lay.seg] / n_seq / g
        elif lt in ("bnpo", "ppo"):
            loss_weight = m / m_total.clamp(min=1.0) / g
        elif lt == "dr_grpo":
            max_len = lead[1] if cfg.max_completion_length is None else cfg.max_completion_length
            loss_weight = m / (n_seq * max_len) / g
        elif lt == "luspo":
            loss_weight = m / n_seq / g
        else:  # dapo, cispo, vespo, reinforce: TRL's num_items_in_batch normalizer
            if num_items_in_batch is None:
                denom = m_total.clamp(min=1.0)
            else:
                n_items = torch.as_tensor(num_items_in_batch, dtype=sdt, device=m.device)
                denom = n_items.clamp(min=1.0) / cfg.num_processes
                if cfg.training:
                    spg = cfg.steps_per_generation or cfg.gradient_accumulation_steps
                    denom = denom * cfg.gradient_accumulation_steps / spg
            loss_weight = m / denom
        bonus_weight = m / m_total.clamp(min=1.0) / g if cfg.entropy_coef != 0.0 else None

        def counted_rows(x: torch.Tensor | None) -> torch.Tensor | None:  # a tensor over `seen`, at `lay`'s tokens
            return None if x is None else x[:lay.n]

        per_seq = advantages.dim() == 1 and advantages.shape[0] == lay.num_segments and advantages.shape != lead
        adv_tok, is_tok = counted_rows(adv_seen), counted_rows(is_seen)
        log_is_seq = None
        if is_tok is not None and cfg.loss_type == "vespo":
            log_is_seq = lay.seq_sum(torch.log(is_tok).clamp(LOG_1E8, 20.0))
        return PolicyTokens(layout=lay, m=lay.weight, advantages=adv_tok,
                            adv_per_sequence=advantages.to(sdt) if per_seq else None,
                            old_logp=counted_rows(seen_logps.get("old_logp")),
                            ref_logp=counted_rows(seen_logps.get("ref_logp")),
                            sampling_logp=counted_rows(seen_logps.get("sampling_logp")), is_ratio=is_tok,
                            log_is_ratio_seq=log_is_seq, loss_weight=loss_weight, bonus_weight=bonus_weight,
                            zero_rows=zero_rows, config=cfg)

    return _Prepared(lay, dataclasses.replace(spec, started=started), pass_hidden, pass_ids, LazyTokens(tokens),
                     checks if defer else None)


def _finalize_metrics(cfg: PolicyConfig, tok: PolicyTokens, sums: dict[str, torch.Tensor],
                      group) -> dict[str, torch.Tensor]:
    """TRL's logged metrics from the per-segment sums: means are reduced as (sum, count) pairs
    and extrema as min/max over ``group``, so they are exact across processes."""
    lay = tok.layout
    seg_len = lay.seg_len
    zeros = seg_len.new_zeros(lay.num_segments)
    policy_part = sums.get("policy", seg_len.new_zeros(()))
    keys = ("kl", "entropy", "low", "high", "cispo", "phi", "log_ratio", "vespo_s", "bonus_entropy", "bonus_tokens")
    sums = {k: sums.get(k, zeros) for k in keys}
    if lay.distributed:  # pieces of each sequence live on the sequence-parallel ranks
        stacked = all_reduce(torch.stack([sums[k] for k in keys]), "sum", lay.group)
        sums = dict(zip(keys, stacked, strict=True))
    total = seg_len.sum()
    # torch.full, not new_tensor: a host-to-device copy would make the host wait for the pass.
    n_seq = torch.full((), float(lay.num_segments), dtype=seg_len.dtype, device=seg_len.device)
    nan = torch.full((), float("nan"), dtype=seg_len.dtype, device=seg_len.device)
    means: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    mins: dict[str, torch.Tensor] = {}
    maxs: dict[str, torch.Tensor] = {}
    if cfg.beta != 0.0:
        means["kl"] = (sums["kl"].sum(), total)
    means["entropy"] = (sums["entropy"].sum(), total)
    lt = cfg.loss_type
    if sequence_metrics(cfg, tok) and lt in (*CLIPPED, "cispo"):
        c1 = torch.exp(sums["log_ratio"] / seg_len.clamp(min=1.0))
        if cfg.delta is not None and lt in CLIPPED:
            c1 = c1.clamp(max=cfg.delta)
        adv = tok.adv_per_sequence
        if lt == "cispo":
            means["cispo_clip_ratio"] = (((c1 > cfg.eps_high) & (adv > 0)).to(c1.dtype).sum(), n_seq)
        else:
            low = ((c1 < 1 - cfg.epsilon) & (adv < 0)).to(c1.dtype)
            high = ((c1 > 1 + cfg.eps_high) & (adv > 0)).to(c1.dtype)
            means["clip_ratio/low_mean"] = (low.sum(), n_seq)
            means["clip_ratio/high_mean"] = (high.sum(), n_seq)
            means["clip_ratio/region_mean"] = ((low + high).sum(), n_seq)
            mins["clip_ratio/low_min"], maxs["clip_ratio/high_max"] = low, high
    elif lt in CLIPPED:
        low, high = sums["low"], sums["high"]
        means["clip_ratio/low_mean"] = (low.sum(), total)
        means["clip_ratio/high_mean"] = (high.sum(), total)
        means["clip_ratio/region_mean"] = ((low + high).sum(), total)
        # TRL's per-sequence mean divides by the raw length: NaN for an empty sequence, then skipped.
        mins["clip_ratio/low_min"], maxs["clip_ratio/high_max"] = low / seg_len, high / seg_len
    elif lt == "cispo":
        means["cispo_clip_ratio"] = (sums["cispo"].sum(), total)
    if lt == "vespo":
        if tok.adv_per_sequence is not None:
            s = sums["vespo_s"] if tok.log_is_ratio_seq is None else sums["vespo_s"] + tok.log_is_ratio_seq
            means["vespo/phi_seq_mean"] = (vespo_phi(cfg, s, tok.adv_per_sequence).sum(), n_seq)
        else:
            means["vespo/phi_seq_mean"] = (sums["phi"].sum(), total)

    if cfg.entropy_coef != 0.0:
        # TRL logs the policy term (before the entropy bonus) as `policy_loss`, undivided by G for the
        # loss types whose normalizer is not num_items_in_batch; across processes, the mean (its nanmean).
        undo_g = _accum(cfg) if lt not in ("dapo", "cispo", "vespo", "reinforce") else 1.0
        means["policy_loss"] = (policy_part * undo_g, seg_len.new_tensor(1.0))
    local = {}
    if cfg.entropy_coef != 0.0:
        # TRL's adaptive entropy controller accumulates these per micro-batch and reduces them
        # over processes at the optimizer step: they stay local here.
        local["entropy_bonus/entropy_sum"] = sums["bonus_entropy"].sum()
        local["entropy_bonus/token_count"] = sums["bonus_tokens"].sum()

    def over_group(t: torch.Tensor, op: str) -> torch.Tensor:  # without a group: this process's values
        return t if group is None else all_reduce(t, op, group)

    names = list(means)
    stacked = over_group(torch.stack([v for k in names for v in means[k]]), "sum") if names else None
    out = {k: stacked[2 * i] / stacked[2 * i + 1].clamp(min=1.0) for i, k in enumerate(names)}
    for k, v in mins.items():  # nanmin over sequences of all processes
        v = over_group(torch.where(torch.isnan(v), torch.inf, v).min() if v.numel() else nan.new_tensor(torch.inf),
                       "min")
        out[k] = torch.where(torch.isinf(v), nan, v)
    for k, v in maxs.items():
        v = over_group(torch.where(torch.isnan(v), -torch.inf, v).max() if v.numel() else nan.new_tensor(-torch.inf),
                       "max")
        out[k] = torch.where(torch.isinf(v), nan, v)
    out.update(local)
    return out
