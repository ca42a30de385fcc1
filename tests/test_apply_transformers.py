"""``apply_logitless``: after the patch a verified model's ``model(input_ids, labels=labels).loss`` and
every parameter's gradient equal those of the unpatched model's own forward, in float64.

The oracle is the unpatched twin (a deep copy taken before patching) running its own forward, head
and transforms included. Its ``loss_function`` is transformers' ``ForCausalLMLoss`` except for one
line: that one upcasts the logits with ``.float()``, so for a float64 model it rounds to fp32; the
twin gets the same loss in float64 (``_causal_lm_loss64``) so the tolerance is rounding, not fp32
error. Its genuine fp32-rounded loss is also compared, at fp32's tolerance.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_model_families import CASES, V, _build
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from logitless import PassOptions, apply_logitless
from logitless.model_heads import UnsupportedModelError

TOL = dict(rtol=0, atol=1e-10)
# One config per family (the first tie setting listed there): 27 verified classes.
FAMILIES = [pytest.param(cls, cfg, kw, ties[0], id=cid) for cid, cls, cfg, kw, ties in CASES]


def _causal_lm_loss64(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """transformers' ForCausalLMLoss without its fp32 upcast."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _twins(cls, cfg, kw, tie, **patch):
    ours = _build(cls, cfg, kw, tie)
    ref = copy.deepcopy(ours)
    ref.loss_function = _causal_lm_loss64
    return ours, ref, apply_logitless(ours, **patch)


def _batch(seed: int, b: int = 2, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (b, t), generator=g)
    labels = ids.clone()
    labels[torch.rand(b, t, generator=g) < 0.3] = -100  # prompt / padding positions
    labels[0, -1] = 7  # a label on the last position: the shift must drop it
    return ids, labels


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(ours, ref):
    got, want = _grads(ours), _grads(ref)
    assert got.keys() == want.keys() and len(want) == len(list(ref.parameters()))
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


@pytest.mark.parametrize("cls, cfg_cls, kwargs, tie", FAMILIES)
def test_loss_and_gradients_match_the_models_own(cls, cfg_cls, kwargs, tie, seed):
    ours, ref, _ = _twins(cls, cfg_cls, kwargs, tie)
    ids, labels = _batch(seed)
    n_items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 5)  # counted tokens of a larger accumulated batch
    # Eval mode (no dropout) with skip_logits=True: the fused path, deterministic.
    out = ours(input_ids=ids, labels=labels, skip_logits=True)
    out_n = ours(input_ids=ids, labels=labels, num_items_in_batch=n_items, skip_logits=True)
    want = ref(input_ids=ids, labels=labels)
    want_n = ref(input_ids=ids, labels=labels, num_items_in_batch=n_items)
    assert out.logits is None and out_n.logits is None
    torch.testing.assert_close(out.loss, want.loss, **TOL)
    torch.testing.assert_close(out_n.loss, want_n.loss, **TOL)
    # A backward seed other than 1 and both reductions in one graph.
    (0.7 * out.loss + 2.0 * out_n.loss).backward()
    (0.7 * want.loss + 2.0 * want_n.loss).backward()
    _assert_same_grads(ours, ref)
    # The model's genuine loss (ForCausalLMLoss rounds the logits to fp32 first).
    ref.__dict__.pop("_loss_function")
    with torch.no_grad():
        own = ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(out.loss.detach().float(), own, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case, eps, z",
    [("gemma2", 0.1, 1e-2), ("granite", 0.2, 0.0), ("llama", 0.0, 1e-3)],
)
def test_label_smoothing_and_z_loss_from_the_models_logits(case, eps, z, seed):
    # Oracle: the unpatched model's float64 logits, torch's label smoothing plus z·lse² per counted token.
    _, cls, cfg, kw, ties = next(c for c in CASES if c[0] == case)
    ours, ref, patch = _twins(cls, cfg, kw, ties[0], label_smoothing=eps, z_loss=z)
    ids, labels = _batch(seed)
    for n_items in (None, 23):
        for m in (ours, ref):
            m.zero_grad()
        loss = ours(input_ids=ids, labels=labels, num_items_in_batch=n_items, skip_logits=True).loss
        logits = ref(input_ids=ids).logits[:, :-1].reshape(-1, V)
        target = labels[:, 1:].reshape(-1)
        counted = target != -100
        ce = F.cross_entropy(logits, target, ignore_index=-100, label_smoothing=eps, reduction="none")
        zl = z * logits.logsumexp(-1) ** 2
        denom = counted.sum() if n_items is None else n_items
        want = (ce.sum() + zl[counted].sum()) / denom
        torch.testing.assert_close(loss, want, **TOL)
        torch.testing.assert_close(patch.last_metrics["z_loss"], zl[counted].sum().detach() / denom, **TOL)
        loss.backward()
        want.backward()
        _assert_same_grads(ours, ref)


def test_moe_router_aux_loss_is_added_by_the_models_forward(seed):
    _, cls, cfg, kw, ties = next(c for c in CASES if c[0] == "mixtral")
    ours, ref, _ = _twins(cls, cfg, kw, ties[0])
    ids, labels = _batch(seed)
    out = ours(input_ids=ids, labels=labels, output_router_logits=True, skip_logits=True)
    want = ref(input_ids=ids, labels=labels, output_router_logits=True)
    assert out.aux_loss is not None and out.aux_loss > 0 and out.logits is None
    torch.testing.assert_close(out.loss, want.loss, **TOL)
    torch.testing.assert_close(out.router_logits, want.router_logits, **TOL)
    out.loss.backward()
    want.loss.backward()
    _assert_same_grads(ours, ref)


@pytest.mark.parametrize("tuner_forward", ["installed", "calls_model_forward"])
def test_lora_on_backbone_and_head(tuner_forward, seed, monkeypatch):
    # "calls_model_forward": PEFT before 0.21, whose tuner calls model.forward(...) directly, passing by any
    # hook on the transformers model; apply_logitless(peft_model) hooks the PEFT model, so it still applies.
    peft = pytest.importorskip("peft")
    if tuner_forward == "calls_model_forward":
        monkeypatch.setattr(
            peft.tuners.tuners_utils.BaseTuner, "forward", lambda self, *a, **k: self.model.forward(*a, **k)
        )
    _, cls, cfg, kw, _ = next(c for c in CASES if c[0] == "gemma2")
    base = _build(cls, cfg, kw, False)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    ours = peft.get_peft_model(base, lora).to(torch.float64)
    ref = copy.deepcopy(ours)
    ref.get_base_model().loss_function = _causal_lm_loss64
    apply_logitless(ours)
    ours.train()
    ref.train()
    ids, labels = _batch(seed)
    out = ours(input_ids=ids, labels=labels)
    want = ref(input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, want.loss, **TOL)
    out.loss.backward()
    want.loss.backward()
    got, exp = _grads(ours), _grads(ref)
    assert got.keys() == exp.keys() and any("lm_head.lora_A" in n for n in exp)
    for name in exp:
        torch.testing.assert_close(got[name], exp[name], **TOL, msg=name)


class _TensorShapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns, forward and backward."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_a_call_that_passes_the_hooks_by_warns_once(seed):
    # model.forward(...) instead of model(...) (what PEFT before 0.21 does to the model it wraps): the hooks
    # do not run, so the logits are built. The model's own loss is returned, with one warning.
    _, cls, cfg, kw, ties = next(c for c in CASES if c[0] == "qwen2")
    model = _build(cls, cfg, kw, ties[0]).train()
    ids, labels = _batch(seed)
    want = model(input_ids=ids, labels=labels).loss
    apply_logitless(model)
    with pytest.warns(UserWarning, match=r"Qwen2ForCausalLM.forward was called directly.*PeftModel"):
        out = model.forward(input_ids=ids, labels=labels)
    assert out.logits is not None and torch.equal(out.loss, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.forward(input_ids=ids, labels=labels)  # once
        assert model(input_ids=ids, labels=labels).logits is None
        model.eval()
        model(input_ids=ids, labels=labels)  # eval: the model's own loss, through the hooks


def test_no_logits_tensor_is_built(seed):
    # 128 tokens, in token chunks of at most 16 rows by the chunk budget: no tensor of the pass may hold
    # a vocabulary dimension beside more than a chunk of tokens. The unpatched model, watched the same
    # way, builds its [2, 64, V] logits (so the watch sees them).
    _, cls, cfg, kw, ties = next(c for c in CASES if c[0] == "llama")
    ours, ref, _ = _twins(cls, cfg, kw, ties[0], options=PassOptions(chunk_bytes=16 * V * 8))
    ours.train()
    ref.train()
    ids = torch.randint(3, V, (2, 64))

    def largest_vocab_tensor(model) -> int:
        with _TensorShapes() as watch:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        # [V, H]: the weight and its gradient
        return max((math.prod(s) // V for s in watch.shapes if V in s and s != (V, 32)), default=0)

    assert largest_vocab_tensor(ref) >= ids.numel()
    assert largest_vocab_tensor(ours) <= 16
    _assert_same_grads(ours, ref)


def test_when_the_patch_applies_and_remove():
    _, cls, cfg, kw, ties = next(c for c in CASES if c[0] == "llama")
    model = _build(cls, cfg, kw, ties[0])
    ids, labels = _batch(3)
    plain = model(input_ids=ids, labels=labels)
    patch = apply_logitless(model, options=PassOptions(mode="recompute"))
    assert patch.active and model.forward.__func__ is type(model).forward  # hooks only; forward untouched
    # Eval mode: the model's own forward (logits and its loss), as Liger's lce_forward.
    out = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.loss, plain.loss, rtol=0, atol=0)
    # Training mode: fused unless skip_logits=False; no labels: logits.
    model.train()
    fused = model(input_ids=ids, labels=labels)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, plain.loss.double(), rtol=1e-6, atol=0)  # plain: fp32-upcast loss
    assert model(input_ids=ids, labels=labels, skip_logits=False).logits.shape == (*ids.shape, V)
    torch.testing.assert_close(model(input_ids=ids).logits, plain.logits, rtol=0, atol=0)
    # return_dict=False: the tuple without the logits (None fields are left out of it).
    as_tuple = model(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
    assert len(as_tuple) == 1 and torch.equal(as_tuple[0], fused.loss)
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        model(input_ids=ids, skip_logits=True)
    assert not patch._calls  # a pre-hook that raised leaves no open call
    # A forward that raises leaves nothing behind (the head and loss_function restored).
    with pytest.raises((ValueError, RuntimeError)):
        model(input_ids=ids, labels=labels[:, :4])
    assert "forward" not in model.lm_head.__dict__ and model.__dict__["_loss_function"] == patch._guard
    assert model(input_ids=ids).logits.shape == (*ids.shape, V)
    # A deep copy (TRL's reference models, EMA copies) is patched on its own; so is a checkpointed model.
    twin = copy.deepcopy(model)
    twin.gradient_checkpointing_enable()
    out = twin(input_ids=ids, labels=labels, use_cache=False)
    assert out.logits is None and torch.equal(out.loss, fused.loss)
    out.loss.backward()
    twin._logitless_apply.remove()
    assert twin(input_ids=ids, labels=labels).logits is not None and model(input_ids=ids, labels=labels).logits is None
    # Applying again replaces; remove() restores the model's own loss.
    again = apply_logitless(model, z_loss=1e-2)
    assert not patch.active and again.active
    assert model(input_ids=ids, labels=labels).loss > fused.loss
    again.remove()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert "_logitless_apply" not in model.__dict__ and "_loss_function" not in model.__dict__
    restored = model(input_ids=ids, labels=labels)
    assert restored.logits is not None and restored.loss.dtype == torch.float32


def test_autocast_bf16_is_at_least_as_close_to_float64_as_the_models_own_loss(seed):
    # An fp32 model under CPU bf16 autocast: both heads take the bf16-rounded hidden states and weight;
    # the oracle is the CE of those operands in float64. The model's own loss rounds its logits to
    # bf16, ours keeps fp32 statistics, so ours must be at least as close (and is returned in fp32).
    _, cls, cfg, kw, ties = next(c for c in CASES if c[0] == "gemma2")
    ours, ref, _ = _twins(cls, cfg, kw, ties[0])
    ours, ref = ours.float().train(), ref.float().train()
    ref.__dict__.pop("_loss_function")
    ids, labels = _batch(seed)
    seen = []
    ref.lm_head.register_forward_hook(lambda m, a, out: seen.append(a[0].detach()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ours(input_ids=ids, labels=labels).loss
        own = ref(input_ids=ids, labels=labels).loss
    assert loss.dtype == own.dtype == torch.float32
    cap = ref.config.final_logit_softcapping
    y = seen[0].bfloat16().double() @ ref.lm_head.weight.bfloat16().double().T
    logits = cap * torch.tanh(y / cap)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    assert (loss.double() - want).abs() <= (own.double() - want).abs() + 1e-6


def test_compiled_model(seed):
    # apply_logitless(torch.compile(model)) patches the model inside; the compiled call fuses as the eager one.
    _, cls, cfg, kw, ties = next(c for c in CASES if c[0] == "llama")
    ours, ref, _ = _twins(cls, cfg, kw, ties[0])
    del ref._loss_function
    compiled = torch.compile(ref, backend="eager")
    apply_logitless(compiled)
    ours.train()
    compiled.train()
    ids, labels = _batch(seed)
    out, want = compiled(input_ids=ids, labels=labels), ours(input_ids=ids, labels=labels)
    assert out.logits is None and want.logits is None
    torch.testing.assert_close(out.loss, want.loss, **TOL)
    out.loss.backward()
    want.loss.backward()
    _assert_same_grads(ref, ours)
    assert compiled(input_ids=ids).logits.shape == (*ids.shape, V)
    torch._dynamo.reset()


def test_unsupported_model_and_bad_arguments_raise_named_errors():
    class MyLlamaForCausalLM(transformers.LlamaForCausalLM):  # a subclass may change forward
        pass

    _, _, cfg, kw, ties = next(c for c in CASES if c[0] == "llama")
    sub = _build("LlamaForCausalLM", cfg, kw, ties[0])
    sub.__class__ = MyLlamaForCausalLM
    with pytest.raises(UnsupportedModelError, match=r"MyLlamaForCausalLM.*Supported: .*LlamaForCausalLM"):
        apply_logitless(sub)
    assert not sub._forward_hooks
    model = _build("LlamaForCausalLM", cfg, kw, ties[0])
    with pytest.raises(ValueError, match="z_loss"):
        apply_logitless(model, z_loss=-1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        apply_logitless(model, label_smoothing=1.5)
    with pytest.raises(TypeError, match="options"):
        apply_logitless(model, options={"mode": "fused"})
    with pytest.raises(TypeError, match="model must be"):
        apply_logitless("meta-llama/Llama-3.2-1B")
    # A loss of the user's own is not silently replaced by CE: refused when patching and when called.
    model.loss_function = _causal_lm_loss64
    with pytest.raises(ValueError, match=r"_causal_lm_loss64.*not transformers' ForCausalLMLoss"):
        apply_logitless(model)
    del model._loss_function
    apply_logitless(model)
    model.loss_function = _causal_lm_loss64
    ids, labels = _batch(5)
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        model(input_ids=ids, labels=labels, skip_logits=True)
    assert model.__dict__["_loss_function"] is _causal_lm_loss64


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, t: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, V, (n, t), generator=g)
        self.labels = self.ids.clone()
        self.labels[:, : t // 3] = -100  # prompt tokens
        for i in range(n):  # right padding of varying length
            self.labels[i, t - i % 4 :] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _train(tmp_path, patched: bool, seed: int):
    _, cls, cfg, kw, ties = next(c for c in CASES if c[0] == "qwen2")
    model = _build(cls, cfg, kw, ties[0]).float()
    if patched:
        apply_logitless(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("patched" if patched else "plain")),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows(8, 10, seed))
    trainer.train()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    return logs, model


def test_trainer_logs_match_an_unpatched_run(tmp_path, seed):
    # Trainer passes num_items_in_batch (counted tokens over the accumulated micro-batches) to the model.
    plain_logs, plain = _train(tmp_path, False, seed % 1000)
    logs, model = _train(tmp_path, True, seed % 1000)
    assert len(logs) == len(plain_logs) == 2
    for (loss, gnorm), (want_loss, want_gnorm) in zip(logs, plain_logs, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert gnorm == pytest.approx(want_gnorm, rel=1e-4)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


DIST_VARIANTS = ("root", "head", "tied", "root_reshard", "ddp")


def _dist_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One gloo rank: the patched and the unpatched (float64-loss) twin, FSDP2-sharded alike (or both in DDP),
    one step on this rank's half of the batch; their losses and reduced gradients, saved for the parent."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    def _full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        ids, labels = _batch(21, b=2 * world)
        n_items = (labels[:, 1:] != -100).sum()  # the whole batch's, as Trainer counts it across ranks
        rows = slice(2 * rank, 2 * rank + 2)
        _, cls, cfg, kw, _ = next(c for c in CASES if c[0] == "llama")
        out = {}
        for variant in DIST_VARIANTS:
            twins = [_build(cls, cfg, kw, variant == "tied").train() for _ in range(2)]
            for m in twins if variant != "ddp" else ():
                for layer in m.model.layers:
                    fully_shard(layer, mesh=mesh)
                if variant == "head":  # the head in a group of its own, resharded after its forward
                    fully_shard(m.lm_head, mesh=mesh)
                elif variant == "tied":  # FSDP2 needs a tied weight's modules in one group
                    fully_shard([m.model.embed_tokens, m.lm_head], mesh=mesh)
                fully_shard(m, mesh=mesh, reshard_after_forward=True if variant == "root_reshard" else None)
            ref = twins[1]
            ref.loss_function = _causal_lm_loss64
            apply_logitless(twins[0])
            ours, ref = twins if variant != "ddp" else [DistributedDataParallel(m) for m in twins]
            got = ours(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=n_items, use_cache=False)
            want = ref(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=n_items, use_cache=False)
            # x world: FSDP and DDP average the gradients over ranks (Trainer scales the loss the same way).
            (world * got.loss).backward()
            (world * want.loss).backward()
            out[variant] = dict(
                logits=got.logits,
                loss=(got.loss.detach(), want.loss.detach()),
                grads=[
                    (_full(p.grad), _full(q.grad)) for p, q in zip(ours.parameters(), ref.parameters(), strict=True)
                ],
            )
        torch.save(out, f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_and_ddp_two_ranks_match_the_models_own(tmp_path):
    # 2 gloo ranks on CPU. FSDP2: the head unsharded in the root group, sharded on its own, tied to the embeddings
    # in one group, and with the root resharding after forward (find_head / head_inputs gather it for the pass).
    # DDP: the hooks are on the model DDP wraps.
    import socket

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_dist_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        res = torch.load(tmp_path / f"{rank}.pt")
        for variant in DIST_VARIANTS:
            r = res[variant]
            assert r["logits"] is None, variant
            torch.testing.assert_close(*r["loss"], **TOL, msg=variant)
            for got, want in r["grads"]:
                torch.testing.assert_close(got, want, **TOL, msg=variant)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_training_step_is_closer_to_float64_and_leaner_than_the_models_own():
    # A bf16 Llama, 32k vocabulary, 2 x 2048 tokens (its bf16 logits alone: 256 MiB, 512 MiB upcast to fp32).
    # Loss: at least as close as the model's own to the float64 CE of the same bf16 operands. Peak memory of
    # a training step: lower by at least the bf16 logits.
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32768,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    ref = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    ours = copy.deepcopy(ref)
    apply_logitless(ours, options=PassOptions(chunk_bytes=128 * 2**20))  # a workspace below the logits' size
    ids = torch.randint(0, cfg.vocab_size, (2, 2048), device="cuda")
    seen = []
    hook = ref.lm_head.register_forward_hook(lambda m, a, out: seen.append(a[0].detach()))

    def step(model):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), torch.cuda.max_memory_allocated() - base

    own, own_peak = step(ref)
    hook.remove()
    loss, peak = step(ours)
    logits = seen[0].double() @ ref.lm_head.weight.double().T
    want = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    assert loss.dtype == torch.float32
    assert (loss.double() - want).abs() <= (own.double() - want).abs() + 1e-5
    assert peak + 2 * 2048 * cfg.vocab_size * 2 <= own_peak, (peak / 2**20, own_peak / 2**20)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        rel = (p.grad.float() - q.grad.float()).norm() / q.grad.float().norm()
        assert rel < 5e-2, (name, rel.item())  # a sanity bound: both are bf16 training steps, ours fp32 inside
