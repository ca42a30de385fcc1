"""TRL's own ``GRPOTrainer._compute_loss`` as the test oracle, on a tiny float64 model."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from tiny_models import save_tiny_qwen2

TRL_DEFAULTS = dict(loss_type="dapo", importance_sampling_level="token", epsilon=0.2, epsilon_high=None, delta=None,
                    beta=0.0, use_bias_correction_kl=True, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
                    entropy_coef=0.0, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                    vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, max_completion_length=8,
                    steps_per_generation=1, gradient_accumulation_steps=1, use_vllm_is=False, temperature=1.0,
                    is_mode="sequence_mask", is_clip=(None, 3.0))


def configure_trainer(tr, **opts) -> None:
    """Set TRL options on a built ``GRPOTrainer`` (or subclass) the way its ``__init__`` stores
    them, in ``tr.args`` too (a subclass deciding from ``args`` sees the same options)."""
    unknown = set(opts) - set(TRL_DEFAULTS)
    assert not unknown, unknown
    o = {**TRL_DEFAULTS, **opts}
    args = tr.args
    eps_high = o["epsilon"] if o["epsilon_high"] is None else o["epsilon_high"]
    lo, hi = o["is_clip"]
    for k, v in dict(delta=o["delta"], use_bias_correction_kl=o["use_bias_correction_kl"],
                     sapo_temperature_pos=o["sapo_temperature_pos"], sapo_temperature_neg=o["sapo_temperature_neg"],
                     vespo_k_pos=o["vespo_k_pos"], vespo_lambda_pos=o["vespo_lambda_pos"],
                     vespo_k_neg=o["vespo_k_neg"], vespo_lambda_neg=o["vespo_lambda_neg"],
                     steps_per_generation=o["steps_per_generation"], loss_type=o["loss_type"],
                     importance_sampling_level=o["importance_sampling_level"], epsilon=o["epsilon"],
                     epsilon_high=eps_high, beta=o["beta"], top_entropy_quantile=o["top_entropy_quantile"],
                     off_policy_mask_threshold=o["off_policy_mask_threshold"], entropy_coef=o["entropy_coef"],
                     use_adaptive_entropy=False, max_completion_length=o["max_completion_length"],
                     temperature=o["temperature"], use_vllm=o["use_vllm_is"],
                     vllm_importance_sampling_correction=o["use_vllm_is"],
                     vllm_importance_sampling_mode=o["is_mode"], vllm_importance_sampling_clip_min=lo,
                     vllm_importance_sampling_clip_max=hi).items():
        object.__setattr__(args, k, v)
    tr.loss_type = o["loss_type"]
    tr.importance_sampling_level = o["importance_sampling_level"]
    tr.epsilon_low = o["epsilon"]
    tr.epsilon_high = eps_high
    tr.beta = o["beta"]
    tr.top_entropy_quantile = o["top_entropy_quantile"]
    tr.off_policy_mask_threshold = o["off_policy_mask_threshold"]
    tr.entropy_coef = o["entropy_coef"]
    tr._entropy_bonus_enabled = o["entropy_coef"] != 0.0
    tr.use_adaptive_entropy = False
    tr.max_completion_length = o["max_completion_length"]
    tr.current_gradient_accumulation_steps = o["gradient_accumulation_steps"]
    tr.temperature = o["temperature"]
    tr.use_vllm = o["use_vllm_is"]
    tr.vllm_importance_sampling_correction = o["use_vllm_is"]
    tr.vllm_importance_sampling_mode = o["is_mode"]
    tr.vllm_importance_sampling_clip_min, tr.vllm_importance_sampling_clip_max = lo, hi


class TRLOracle:
    """Builds one ``GRPOTrainer`` and evaluates its loss, gradients and metrics for crafted inputs."""

    def __init__(self, vocab_size: int = 64, hidden_size: int = 32) -> None:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        self.dir = Path(tempfile.mkdtemp(prefix="logitless-trl-"))
        save_tiny_qwen2(self.dir, vocab_size=vocab_size, hidden_size=hidden_size)
        from tiny_models import word_tokenizer

        args = GRPOConfig(output_dir=str(self.dir / "out"), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, beta=0.0, report_to=[], use_cpu=True, logging_steps=1)
        self.trainer = GRPOTrainer(model=str(self.dir), reward_funcs=lambda completions, **k: [0.0] * len(completions),
                                   args=args, train_dataset=Dataset.from_dict({"prompt": ["t1 t2"] * 8}),
                                   processing_class=word_tokenizer(vocab_size))
        self.model = self.trainer.model.double()
        self.vocab_size = vocab_size
        # TRL 1.16's default head computes its statistics in fp32 whatever the model dtype. The oracle
        # replaces it with TRL's plain path (full logits, TRL's own selective_log_softmax and
        # entropy_from_logits) so that a float64 model gives float64 log-probs; the rest of
        # `_compute_loss` is TRL's code, untouched.
        self.trainer._get_per_token_logps_and_entropies = self._plain_logps_and_entropies

    def _plain_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                   compute_entropy=False, compute_aux_loss=False, **_):
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, -logits_to_keep - 1:-1] / self.trainer.temperature
        ids = input_ids[:, -logits_to_keep:]
        logps = selective_log_softmax(logits, ids)
        entropies = entropy_from_logits(logits) if compute_entropy else None
        return logps, entropies, None

    def configure(self, **opts) -> None:
        """Set TRL options the way ``GRPOTrainer.__init__`` stores them."""
        configure_trainer(self.trainer, **opts)

    def hidden_states(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        """``[B, T, H]`` final hidden states TRL's head consumes at the completion positions."""
        caught = {}
        handle = self.model.model.norm.register_forward_hook(lambda _m, _i, out: caught.__setitem__("h", out))
        try:
            with torch.no_grad():
                self.model(input_ids=torch.cat([prompt_ids, completion_ids], 1),
                           attention_mask=torch.cat([prompt_mask, completion_mask], 1))
        finally:
            handle.remove()
        p, t = prompt_ids.shape[1], completion_ids.shape[1]
        return caught["h"][:, p - 1:p + t - 1].clone()

    def run(self, inputs: dict, training: bool = True):
        """``(loss, grad_hidden [B, T, H], grad_weight [V, H], metrics, hidden [B, T, H])``."""
        model = self.model
        model.train(training)
        model.zero_grad(set_to_none=True)
        caught = {}

        def hook(_mod, _inp, out):
            out.retain_grad()
            caught["h"] = out

        handle = model.model.norm.register_forward_hook(hook)
        try:
            self.trainer._metrics["train"].clear()
            self.trainer._metrics["eval"].clear()
            loss = self.trainer._compute_loss(model, inputs)
            loss.backward()
        finally:
            handle.remove()
        p, t = inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]
        h = caught["h"]
        mode = "train" if training else "eval"
        metrics = {k: v[-1] for k, v in self.trainer._metrics[mode].items()}
        w = model.lm_head.weight
        return (loss.detach(), h.grad[:, p - 1:p + t - 1].clone(), w.grad.clone(), metrics,
                h.detach()[:, p - 1:p + t - 1].clone())


# With sampler log-probs logitless also reports the trainer-sampler mismatch at the loss (TRL logs
# its own sampling metrics at generation, from the old log-probs; checked in
# test_sampler_diagnostics.py): names ours may have beside TRL's.
SAMPLER_MISMATCH = ("sampling/trainer_sampler_logp_difference/mean", "sampling/trainer_sampler_logp_difference/max",
                    "sampling/trainer_sampler_ratio_error/mean", "sampling/trainer_sampler_ratio_error/max")


class TensorAccelerator:
    """The parts of ``accelerate.Accelerator`` TRL's ``_compute_loss`` uses: identities on one
    process, or torch.distributed collectives over ``group`` (every process of a data-parallel run)."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        self.group = group
        self.num_processes = dist.get_world_size(group) if group is not None else 1
        self.device = torch.device("cpu")
        self.sync_gradients = True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.num_processes)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([p.reshape(-1) if x.dim() == 0 else p for p in parts])

    gather_for_metrics = gather

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        assert reduction == "sum"
        if self.group is not None:
            x = x.clone()
            dist.all_reduce(x, group=self.group)
        return x

    def pad_across_processes(self, x: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        import torch.distributed as dist

        assert dim == 0
        if self.group is None:
            return x
        n = torch.tensor([x.shape[0]])
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        return torch.cat([x, x.new_full((int(n) - x.shape[0], *x.shape[1:]), pad_index)])


def trl_grpo_loss(hidden, weight, completion_ids, mask, advantages, old_logp, ref_logp=None, *,
                  num_items_in_batch=None, group=None, temperature: float = 1.0, training: bool = True, **opts):
    """TRL 1.16's own ``GRPOTrainer._compute_loss`` on tensors: a stub trainer whose model returns
    the float64 materialized logits ``hidden @ weight.T / temperature`` (TRL's own
    ``selective_log_softmax`` / ``entropy_from_logits`` on them); every option, normalizer,
    mask and metric is TRL's code. ``group``: TRL's multi-process semantics over that process
    group (each process passes its own rows). ``opts``: :func:`configure_trainer`'s options.

    Returns ``(loss, metrics)``: the loss is differentiable w.r.t. ``hidden`` and ``weight``."""
    import types
    from collections import defaultdict

    from trl import GRPOTrainer
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    class Stub:
        get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask
        get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
        get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **_):
            logits = (hidden.double() @ weight.double().T) / temperature
            return selective_log_softmax(logits, completion_ids), entropy_from_logits(logits), None

    stub = Stub()
    stub.args = types.SimpleNamespace()
    stub.accelerator = TensorAccelerator(group)
    stub.model = types.SimpleNamespace(training=training)
    stub.aux_loss_enabled = False
    stub._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    configure_trainer(stub, temperature=temperature, **opts)
    b = completion_ids.shape[0]
    inputs = dict(prompt_ids=completion_ids.new_zeros(b, 0), prompt_mask=mask.new_zeros(b, 0),
                  completion_ids=completion_ids, completion_mask=mask, advantages=advantages,
                  old_per_token_logps=old_logp, ref_per_token_logps=ref_logp,
                  num_items_in_batch=mask.sum().double() if num_items_in_batch is None else num_items_in_batch)
    loss = GRPOTrainer._compute_loss(stub, stub.model, inputs)
    mode = "train" if training else "eval"
    return loss, {k: v[-1] for k, v in stub._metrics[mode].items()}
