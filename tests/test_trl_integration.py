"""The TRL drop-in: same loss, gradients, metrics and rollout log-probs as TRL's own trainer."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_qwen2, word_tokenizer

from logitless.integrations.config import LogitlessConfig
from logitless.integrations.trl import LogitlessGRPOTrainer, UnsupportedConfigError, patch_grpo_trainer, trl_own_path
from logitless.model_heads import UnsupportedModelError, find_head

V = 64


def _trainer(tmp_path, cls=LogitlessGRPOTrainer, tie=False, ref_cache=None, logitless_config=None, model=None,
             rollout_func=None, peft_config=None, **config):
    from datasets import Dataset
    from trl import GRPOConfig

    if model is None:
        save_tiny_qwen2(tmp_path / "m", vocab_size=V, tie=tie, seed=1)
    opts = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, report_to=[], use_cpu=True, logging_steps=1, max_steps=2, bf16=False)
    opts.update(config)
    extra = {} if ref_cache is None else {"ref_cache": ref_cache}
    if logitless_config is not None:
        extra["logitless_config"] = logitless_config
    if rollout_func is not None:
        extra["rollout_func"] = rollout_func
    if peft_config is not None:
        extra["peft_config"] = peft_config
    return cls(**extra, model=model if model is not None else str(tmp_path / "m"),
               reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
               args=GRPOConfig(**opts), train_dataset=Dataset.from_dict({"prompt": ["t1 t2", "t3 t4 t5"] * 8}),
               processing_class=word_tokenizer(V))


def _inputs(trainer, seed):
    g = torch.Generator().manual_seed(seed)
    b, p, t = 4, 3, 6
    mask = (torch.rand(b, t, generator=g) > 0.25).long()
    mask[1, 3:] = 0
    ids = torch.randint(0, V - 3, (b, p + t), generator=g)
    inputs = dict(prompt_ids=ids[:, :p], prompt_mask=torch.ones(b, p, dtype=torch.long), completion_ids=ids[:, p:],
                  completion_mask=mask, advantages=torch.randn(b, generator=g),
                  num_items_in_batch=mask.sum().float())
    with torch.no_grad():
        cur, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), t)
    inputs["old_per_token_logps"] = cur + 0.3 * torch.randn(b, t, generator=g)
    inputs["ref_per_token_logps"] = cur + 0.3 * torch.randn(b, t, generator=g)
    return inputs


def _loss_and_grads(trainer, inputs, trl_own=False):
    """Loss, flat gradient of every parameter, and logged metrics; ``trl_own`` runs TRL's own
    head and ``_compute_loss`` on the same trainer state."""
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    if trl_own:
        with trl_own_path(trainer):
            loss = trainer._compute_loss(trainer.model, inputs)
    else:
        loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters() if p.grad is not None])
    return loss.detach(), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize(("loss_type", "level", "beta", "extra"), [
    ("dapo", "token", 0.04, {}), ("grpo", "sequence", 0.0, {}), ("bnpo", "token", 0.1, {}),
    # the static entropy bonus: its loss term and TRL's `policy_loss` and `entropy_coef` metrics
    ("grpo", "token", 0.04, dict(entropy_coef=0.05)), ("dapo", "sequence", 0.0, dict(entropy_coef=-0.02))])
def test_loss_grads_metrics_match_trl(tmp_path, loss_type, level, beta, extra):
    tr = _trainer(tmp_path, loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_high=0.28,
                  **extra)
    assert tr.logitless.fused_loss
    tr.model.train()
    tr.current_gradient_accumulation_steps = 2
    inputs = _inputs(tr, seed=3)
    ours = _loss_and_grads(tr, inputs)
    theirs = _loss_and_grads(tr, inputs, trl_own=True)
    # TRL's head computes in fp32: compare at fp32 accuracy.
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    assert (ours[1] - theirs[1]).norm() <= 1e-5 * theirs[1].norm()
    assert set(ours[2]) == set(theirs[2])
    assert ("policy_loss" in theirs[2]) == bool(extra)
    for k, v in theirs[2].items():
        assert ours[2][k] == pytest.approx(v, rel=1e-5, abs=1e-7, nan_ok=True), k


def test_rollout_logps_match_trl_head(tmp_path):
    from trl import GRPOTrainer

    tr = _trainer(tmp_path)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V - 3, (3, 9), generator=g)
    am = torch.ones_like(ids)
    am[0, :2] = 0  # left padding
    am[2, -2:] = 0  # padded completion
    with torch.no_grad():
        ours, ent, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, am, 5, compute_entropy=True)
        theirs, ent_t, _ = GRPOTrainer._get_per_token_logps_and_entropies(tr, tr.model, ids, am, 5,
                                                                          compute_entropy=True)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert torch.allclose(ent, ent_t, rtol=1e-5, atol=1e-6)
    assert (ours[2, -2:] == 0).all()


def test_trains_and_logs_trl_metrics(tmp_path):
    tr = _trainer(tmp_path, beta=0.04, loss_type="dapo")
    tr.train()
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert len(logged) == 2
    for k in ("kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_min"):
        assert k in logged[-1]
    assert torch.isfinite(torch.tensor(logged[-1]["entropy"]))


def test_tied_embeddings_head_is_found(tmp_path):
    tr = _trainer(tmp_path, tie=True)
    head = find_head(tr.model)
    assert head.weight is tr.model.get_input_embeddings().weight


def test_patch_existing_trainer(tmp_path):
    from trl import GRPOTrainer

    tr = _trainer(tmp_path, cls=GRPOTrainer)
    patched = patch_grpo_trainer(tr, LogitlessConfig(mode="recompute"))
    assert isinstance(patched, LogitlessGRPOTrainer) and patched.logitless.config.mode == "recompute"
    assert patched.logitless.fused_loss and patched.logitless.fused_logprobs
    inputs = _inputs(patched, seed=7)
    patched.model.train()
    patched.current_gradient_accumulation_steps = 1
    ours = _loss_and_grads(patched, inputs)
    theirs = _loss_and_grads(patched, inputs, trl_own=True)
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-7)


class _PassCalls:
    """Counts logitless passes the trainer starts (its ``vocab_stats`` / ``token_logprobs``)."""

    def __init__(self, monkeypatch):
        import logitless.integrations.trl as trl_mod

        self.n = 0
        for name in ("vocab_stats", "token_logprobs"):
            monkeypatch.setattr(trl_mod, name, self._counted(getattr(trl_mod, name)))

    def _counted(self, fn):
        def wrapper(*args, **kwargs):
            self.n += 1
            return fn(*args, **kwargs)

        return wrapper


@pytest.mark.parametrize("switches", [dict(fused_loss=False), dict(fused_loss=False, fused_logprobs=False)],
                         ids=["trl_loss_on_logitless_logprobs", "all_off"])
def test_switches_off_run_trls_own_code(tmp_path, monkeypatch, switches):
    tr = _trainer(tmp_path, beta=0.04, logitless_config=LogitlessConfig(**switches))
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    assert not tr.logitless.fused_loss and tr.logitless.fused_logprobs == switches.get("fused_logprobs", True)
    assert tr.logitless.why_not["fused_loss"] == "set to False"
    inputs = _inputs(tr, seed=11)
    calls = _PassCalls(monkeypatch)
    ours = _loss_and_grads(tr, inputs)
    # TRL's _compute_loss runs either way; with fused_logprobs its log-probs and entropies come
    # from logitless (vocab_stats, differentiable), else from TRL's own head.
    assert (calls.n > 0) == tr.logitless.fused_logprobs
    theirs = _loss_and_grads(tr, inputs, trl_own=True)
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    assert (ours[1] - theirs[1]).norm() <= 1e-5 * theirs[1].norm()
    assert ours[2] == pytest.approx(theirs[2], rel=1e-5, abs=1e-7)


def test_option_not_reproduced_falls_back_to_trls_loss(tmp_path):
    adaptive = dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=1.0)
    tr = _trainer(tmp_path, **adaptive)  # auto: resolves off without a warning
    assert not tr.logitless.fused_loss and tr.logitless.fused_logprobs
    assert "use_adaptive_entropy" in tr.logitless.why_not["fused_loss"]
    with pytest.warns(UserWarning, match=r"fused_loss=True cannot be honoured .*use_adaptive_entropy"):
        explicit = _trainer(tmp_path / "b", logitless_config=LogitlessConfig(fused_loss=True), **adaptive)
    assert not explicit.logitless.fused_loss


def test_explicit_logprobs_switch_warns_once_per_reason(tmp_path):
    tr = _trainer(tmp_path, logitless_config=LogitlessConfig(fused_logprobs=True))
    ids = torch.randint(0, V - 3, (2, 7), generator=torch.Generator().manual_seed(2))
    # A multimodal-style extra input (Qwen2 ignores token_type_ids) sends the call to TRL's own path.
    extra = dict(token_type_ids=torch.zeros_like(ids))
    with pytest.warns(UserWarning, match=r"fused_logprobs=True cannot be honoured .*token_type_ids"):
        with torch.no_grad():
            a, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, torch.ones_like(ids), 4, **extra)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must not warn again
        with torch.no_grad():
            b, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, torch.ones_like(ids), 4, **extra)
            c, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, torch.ones_like(ids), 4)
    assert torch.equal(a, b) and torch.allclose(a, c, rtol=1e-5, atol=1e-6)


def test_unrecognized_head_resolves_to_trls_path(tmp_path, monkeypatch):
    import logitless.integrations.trl_head as trl_head

    def refuse(model):
        raise UnsupportedModelError(f"{type(model).__name__} is not verified")

    monkeypatch.setattr(trl_head, "find_head", refuse)
    with pytest.warns(UserWarning, match="fused_loss=True cannot be honoured .*not verified"):
        tr = _trainer(tmp_path, logitless_config=LogitlessConfig(fused_loss=True))
    assert not tr.logitless.fused_loss and not tr.logitless.fused_logprobs
    with pytest.raises(TypeError, match="fused_loss must be True, False or None"):
        LogitlessConfig(fused_loss="yes")


def test_refuses_unknown_head():
    class NoHead(torch.nn.Module):
        config = None

        def get_output_embeddings(self):
            return None

    with pytest.raises(UnsupportedModelError, match="NoHead"):
        find_head(NoHead())


def test_reference_cache_replaces_the_reference_model(tmp_path):
    """beta > 0 with a ref cache: the reference model is freed and its log-probs come from the
    cache, equal to a live reference pass (the policy before any step has the same weights)."""
    from logitless.integrations.trl import FixedCompletions
    from logitless.refcache import build

    tr = _trainer(tmp_path, beta=0.04)
    g = torch.Generator().manual_seed(9)
    b, p, t = 4, 3, 5
    ids = torch.randint(0, V - 3, (b, p + t), generator=g)
    am = torch.ones_like(ids)
    am[1, -2:] = 0
    records = [{"prompt_ids": ids[i, :p], "completion_ids": ids[i, p:], "completion_mask": am[i, p:]}
               for i in range(b)]
    build(tr.ref_model, records, tmp_path / "cache", tokenizer=tr.processing_class)
    with torch.no_grad():
        live, _, _ = tr._get_per_token_logps_and_entropies(tr.ref_model, ids, am, t)
    fixed = FixedCompletions({"t1 t2": ["t5"], "t3 t4 t5": ["t6"]}, tr.processing_class)
    tr2 = _trainer(tmp_path / "second", beta=0.04, ref_cache=tmp_path / "cache", rollout_func=fixed)
    assert type(tr2.ref_model).__name__ == "_CachedReference"
    with torch.no_grad():
        cached, _, _ = tr2._get_per_token_logps_and_entropies(tr2.ref_model, ids, am, t)
    assert torch.allclose(cached, live, rtol=1e-6, atol=1e-6)
    assert (cached[1, -2:] == 0).all()
    # These completions are not in this cache: training stops with a named miss, never runs on
    # wrong reference values.
    from logitless.refcache import RefCacheMissError

    with pytest.raises(RefCacheMissError):
        tr2.train()


def test_reference_cache_refused_when_the_trainer_samples(tmp_path):
    # Sampled completions are never in a cache built beforehand: refused at construction, with
    # the reason and the fixed-completion route, instead of a RefCacheMissError at step 1.
    with pytest.raises(UnsupportedConfigError, match=r"generates them \(no rollout_func.*FixedCompletions"):
        _trainer(tmp_path, beta=0.04, ref_cache=tmp_path / "never-opened")


def test_reference_cache_on_fixed_completions_trains_as_trl_does(tmp_path):
    """GRPO on completions fixed in advance (TRL's rollout_func): two steps with the reference
    served from a cache log the loss and KL of TRL's own trainer with its live reference model."""
    from trl import GRPOTrainer

    from logitless.integrations.trl import FixedCompletions
    from logitless.refcache import build

    save_tiny_qwen2(tmp_path / "m", vocab_size=V, seed=1)
    tok = word_tokenizer(V)
    fixed = FixedCompletions({"t1 t2": ["t5 t6 t7", "t8", "t9 t10", "t11 t12 t13 t14"],
                              "t3 t4 t5": ["t20", "t21 t22", "t23 t24 t25", "t26 t27"]}, tok)
    opts = dict(beta=0.1, learning_rate=0.05, rollout_func=fixed)
    theirs = _trainer(tmp_path / "trl", cls=GRPOTrainer, model=str(tmp_path / "m"), **opts)
    build(theirs.ref_model, fixed.records(), tmp_path / "cache", tokenizer=tok)
    ours = _trainer(tmp_path / "ours", model=str(tmp_path / "m"), ref_cache=tmp_path / "cache", **opts)
    assert type(ours.ref_model).__name__ == "_CachedReference" and ours.logitless.active
    for tr in (theirs, ours):
        tr.train()
    logs = [[h for h in tr.state.log_history if "loss" in h] for tr in (theirs, ours)]
    assert len(logs[0]) == len(logs[1]) == 2
    assert logs[1][1]["kl"] > 1e-4  # the policy moved: the reference matters at step 2
    for a, b in zip(*logs, strict=True):
        for k in ("loss", "kl", "entropy", "reward"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
        assert b["logitless/active"] == 1.0 and "logitless/active" not in a


def _ours_and_trls(tr, ref, seed: int):
    """One training-mode loss through ``tr`` (loss and gradients) and TRL's own ``_compute_loss``
    through ``ref`` (the same model with its adapter merged) on the same random inputs."""
    for t in (tr, ref):
        t.model.train()
        t.current_gradient_accumulation_steps = 1
    inputs = _inputs(ref, seed=seed)
    ours = _loss_and_grads(tr, inputs)
    with trl_own_path(ref):
        theirs = ref._compute_loss(ref.model, inputs)
    return ours, theirs


def test_reference_cache_refuses_moving_reference(tmp_path):
    with pytest.raises(UnsupportedConfigError, match="sync_ref_model"):
        _trainer(tmp_path, beta=0.04, sync_ref_model=True, ref_cache=tmp_path / "nope")


def test_peft_lora_on_the_head_trains_the_adapter(tmp_path):
    # TRL refuses peft_config with lm_head in target_modules (its head reads lm_head.weight, so the
    # adapter would never train). Given a PeftModel with a LoRA head, the logitless trainer computes
    # the loss of the adapted head (equal to TRL's own loss on the merged model) and the head's
    # adapter gets its gradient.
    import copy

    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    save_tiny_qwen2(tmp_path / "m", vocab_size=V, seed=1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "m"), cfg)
    merged = copy.deepcopy(model).merge_and_unload()
    tr = _trainer(tmp_path / "a", beta=0.04, model=model)
    ref = _trainer(tmp_path / "b", beta=0.04, model=merged)
    assert find_head(tr.model).lora is not None
    ours, theirs = _ours_and_trls(tr, ref, seed=13)
    assert torch.allclose(ours[0], theirs.detach(), rtol=1e-5, atol=1e-7)
    grads = {n: p.grad for n, p in tr.model.named_parameters() if p.grad is not None}
    head_b = [g for n, g in grads.items() if "lm_head.lora_B" in n]
    assert head_b and head_b[0].abs().max() > 0
    # TRL's own head would ignore the adapter: a configuration that would run it is refused.
    lora_model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "m"), cfg)
    with pytest.raises(UnsupportedConfigError, match="LoRA adapter on lm_head"):
        _trainer(tmp_path / "c", model=lora_model, logitless_config=LogitlessConfig(fused_loss=False))


def _tiny_bloom(path):
    """A BLOOM model (a class find_head has not verified), saved to ``path``."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(3)
    BloomForCausalLM(BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4, pad_token_id=V - 3,
                                 eos_token_id=V - 2, bos_token_id=V - 2)).save_pretrained(path)
    return str(path)


def _qwen2_subclass(path, scale=None):
    """A user's subclass of a verified class, optionally scaling the logits in its forward."""
    from transformers import Qwen2ForCausalLM

    class MyQwen2(Qwen2ForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if scale is not None:
                out.logits = out.logits * scale
            return out

    save_tiny_qwen2(path, vocab_size=V, seed=1)
    return MyQwen2.from_pretrained(path)


def test_unverified_class_warns_once_and_logs_inactive(tmp_path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = _trainer(tmp_path, model=_tiny_bloom(tmp_path / "bloom"), max_steps=1)
        tr.train()
    said = [str(w.message) for w in caught if "runs the trainer's own code throughout" in str(w.message)]
    assert len(said) == 1 and "BloomForCausalLM" in said[0] and "allow_unverified" in said[0]
    assert not tr.logitless.active and tr.logitless.backend is None
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert logged[-1]["logitless/active"] == 0.0


def test_both_switches_off_on_purpose_does_not_warn(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tr = _trainer(tmp_path, logitless_config=LogitlessConfig(fused_loss=False, fused_logprobs=False))
    assert not tr.logitless.active


@pytest.mark.parametrize("kind", ["bloom", "qwen2_subclass"])
def test_allow_unverified_takes_the_class_after_its_probe(tmp_path, kind):
    import warnings

    model = _tiny_bloom(tmp_path / "bloom") if kind == "bloom" else _qwen2_subclass(tmp_path / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tr = _trainer(tmp_path, model=model, beta=0.04, logitless_config=LogitlessConfig(allow_unverified=True))
    assert tr.logitless.fused_loss and tr.logitless.fused_logprobs, tr.logitless.why_not
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    inputs = _inputs(tr, seed=17)
    ours = _loss_and_grads(tr, inputs)
    theirs = _loss_and_grads(tr, inputs, trl_own=True)
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    assert (ours[1] - theirs[1]).norm() <= 1e-5 * theirs[1].norm()
    for k, v in theirs[2].items():
        assert ours[2][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_allow_unverified_refuses_a_forward_it_does_not_reproduce(tmp_path):
    # The subclass doubles the logits after the head: the probe sees it and logitless stays off.
    with pytest.warns(UserWarning, match=r"runs the trainer's own code throughout.*differ from the model's own logits"):
        tr = _trainer(tmp_path, model=_qwen2_subclass(tmp_path / "m", scale=2.0),
                      logitless_config=LogitlessConfig(allow_unverified=True))
    assert not tr.logitless.active
    with pytest.raises(UnsupportedModelError):
        find_head(tr.model)  # nothing was recorded on the model


def test_trl_version_guard_warns_once(monkeypatch):
    import warnings

    import trl

    from logitless.integrations.trl_head import TESTED_TRL, check_trl_version

    assert trl.__version__.startswith(TESTED_TRL + ".")  # CI runs the tested release
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    check_trl_version.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"reproduce TRL 1\.16\.\*, found trl 1\.17\.0"):
            check_trl_version()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            check_trl_version()  # once per process
    finally:
        check_trl_version.cache_clear()


def test_switches_show_the_resolved_backend(tmp_path):
    tr = _trainer(tmp_path)
    assert tr.logitless.options.impl == "auto" and tr.logitless.backend == "torch"  # CPU
    assert "backend='torch'" in repr(tr.logitless)


def test_peft_config_with_lm_head_is_accepted(tmp_path):
    # TRL refuses peft_config with lm_head in target_modules ("Remove 'lm_head'"); the drop-in wraps
    # the model as TRL does and computes the adapted head: its loss is TRL's on the merged model.
    import copy

    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    tr = _trainer(tmp_path / "a", beta=0.04, peft_config=cfg)
    assert find_head(tr.model).lora is not None and tr.logitless.active
    merged = copy.deepcopy(tr.model).merge_and_unload()
    ref = _trainer(tmp_path / "b", beta=0.04, model=merged)
    ours, theirs = _ours_and_trls(tr, ref, seed=19)
    assert torch.allclose(ours[0], theirs.detach(), rtol=1e-5, atol=1e-7)
    head_b = [p.grad for n, p in tr.model.named_parameters() if "lm_head.lora_B" in n and p.grad is not None]
    assert head_b and head_b[0].abs().max() > 0


def test_fixed_completions_rollout():
    from logitless.integrations.trl import FixedCompletions

    tok = word_tokenizer(V)
    fixed = FixedCompletions({"t1 t2": ["t5 t6", "t7"], "t3": ["t8"]}, tok)
    out = fixed(["t1 t2", "t1 t2", "t1 t2", "t3"], None)  # TRL repeats each prompt num_generations times
    eos = tok.eos_token_id
    assert out["prompt_ids"] == [[1, 2], [1, 2], [1, 2], [3]] and out["logprobs"] is None
    assert out["completion_ids"] == [[5, 6, eos], [7, eos], [5, 6, eos], [8, eos]]  # member i gets i mod n
    assert sorted(map(str, fixed.records())) == sorted(map(str, [
        {"prompt_ids": [1, 2], "completion_ids": [5, 6, eos]}, {"prompt_ids": [1, 2], "completion_ids": [7, eos]},
        {"prompt_ids": [3], "completion_ids": [8, eos]}]))
    with pytest.raises(ValueError, match="no completions for prompt 't9'"):
        fixed(["t9"], None)
    with pytest.raises(ValueError, match="tokenizes to no tokens"):
        FixedCompletions({"": ["t1"]}, tok)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_switches_show_the_backend_auto_resolves_to_on_a_gpu(tmp_path):
    import importlib.util

    tr = _trainer(tmp_path, use_cpu=False, bf16=True)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    expected = ("gemm" if hopper else "triton") if importlib.util.find_spec("triton") else "torch"
    assert tr.logitless.backend == expected
