"""``policy_loss``, ``cross_entropy``, ``vocab_stats`` and ``token_logprobs`` inside
``torch.compile(fullgraph=True)`` through their custom ops (``logitless/objectives/compiled.py``).

A tiny float64 model (embedding -> linear -> tanh, and a linear head with a bias) plus the loss is
compiled whole; loss, metrics and every parameter gradient must equal the same step run eagerly.
The backends that need no C++ compiler (``eager``: dynamo and the ops' fake implementations;
``aot_eager``: also AOTAutograd's joint graph through the registered autograd) run every case;
inductor runs one. The eager numbers themselves are checked against float64 materialized logits
here for the per-token statistics and in the policy/CE test files for the losses.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import logitless
from logitless import Head, HeadLoRA, LogitTransform, PassOptions, PolicyConfig
from logitless.objectives.policy_terms import metric_names

V, H, B, T = 37, 16, 3, 7  # odd vocabulary
# The compiled step runs the same eager kernels on the same float64 inputs; only the backbone's
# backward may be re-derived by AOTAutograd (another rounding of tanh'): float64 roundoff, ~1e-16.
TOL = 1e-12


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V)
        self.double()

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.embed(ids)))


def head_of(model: TinyModel, lora: HeadLoRA | None = None) -> Head:
    return Head(model.lm_head.weight, model.lm_head.bias, transform=LogitTransform(temperature=0.7), lora=lora)


def step_and_grads(step, model: TinyModel, params: list[torch.Tensor], *args):
    """``step(model, *args) -> (loss, metrics)``; its loss, detached metrics and the gradients of
    ``params`` (``None`` where none)."""
    for p in params:
        p.grad = None
    loss, metrics = step(model, *args)
    if loss.requires_grad:
        loss.backward()
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, [p.grad for p in params]


def assert_same(got, want, tol: float = TOL) -> None:
    loss, metrics, grads = got
    assert torch.allclose(loss, want[0], rtol=tol, atol=tol * want[0].abs().max().item())
    assert list(metrics) == list(want[1])  # the same keys in the same order
    for k, v in metrics.items():
        assert v.dtype == want[1][k].dtype, k
        assert torch.allclose(v, want[1][k], rtol=tol, atol=tol / 100, equal_nan=True), k
    for g, w in zip(grads, want[2], strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            assert torch.allclose(g, w, rtol=tol, atol=tol * w.abs().max().item())


def compiled_equals_eager(step, model, params, backend: str, *args) -> None:
    want = step_and_grads(step, model, params, *args)
    got = step_and_grads(torch.compile(step, backend=backend, fullgraph=True), model, params, *args)
    assert_same(got, want)


def policy_batch(seed: int, b: int = B, t: int = T) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.25).long()
    mask[:, 0] = 1
    return dict(ids=torch.randint(0, V, (b, t + 1), generator=g), mask=mask,
                adv=torch.randn(b, generator=g, dtype=torch.float64),
                old=-2.0 - torch.rand(b, t, generator=g, dtype=torch.float64),
                ref=-2.0 - torch.rand(b, t, generator=g, dtype=torch.float64))


POLICY_CASES = {
    # clip metrics, KL, the sampler-mismatch metrics (views of one tensor in eager), fused mode
    "dapo-sampler-fused": (PolicyConfig(loss_type="dapo", beta=0.04, epsilon_high=0.28), "fused", False),
    # entropy bonus metrics, recompute mode, a LoRA adapter's factors as inputs of the op
    "grpo-bonus-lora-recompute": (PolicyConfig(loss_type="grpo", entropy_coef=0.01), "recompute", True),
    # GSPO on packed sequences with a tensor num_items_in_batch
    "gspo-packed": (PolicyConfig(loss_type="dapo", importance_sampling_level="sequence"), "auto", False),
}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_policy_loss_compiled_equals_eager(seed, case, backend):
    cfg, mode, with_lora = POLICY_CASES[case]
    model = TinyModel()
    x = policy_batch(seed)
    lora = None
    params = list(model.parameters())
    if with_lora:
        g = torch.Generator().manual_seed(seed + 1)
        lora = HeadLoRA(torch.randn(2, H, generator=g, dtype=torch.float64).mul(0.3).requires_grad_(),
                        torch.randn(V, 2, generator=g, dtype=torch.float64).mul(0.3).requires_grad_(), scaling=2.0)
        params += [lora.a, lora.b]
    packed = case == "gspo-packed"
    keep = x["mask"].bool()
    segments = torch.arange(B).repeat_interleave(keep.sum(1))

    def step(model, x):
        h = model.hidden(x["ids"][:, :-1])
        ids, mask, old, ref = x["ids"][:, 1:], x["mask"], x["old"], x["ref"]
        extra = {"sampling_logp": old + 0.05} if case == "dapo-sampler-fused" else {}
        if packed:  # only the counted tokens, one sequence after another
            h, ids, mask, old, ref = h[keep], ids[keep], mask[keep], old[keep], ref[keep]
            extra = {"segment_ids": segments, "num_items_in_batch": mask.sum() + 3}
        loss, metrics = logitless.policy_loss(h, head_of(model, lora), ids, mask, x["adv"], old, ref, config=cfg,
                                              options=PassOptions(mode=mode), **extra)
        return 3.0 * loss, metrics  # an incoming gradient other than 1 (GradScaler)

    compiled_equals_eager(step, model, params, backend, x)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_compiled_equals_eager(seed, reduction, backend):
    model = TinyModel()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    labels = ids[:, 1:].masked_fill(torch.rand(B, T, generator=g) < 0.25, -100)
    weights = torch.rand(B, T, generator=g, dtype=torch.float64)  # a per-token incoming gradient

    count = int((labels != -100).sum()) + 2  # a number: becomes a tensor input of the op

    def step(model, ids):
        loss, metrics = logitless.cross_entropy(model.hidden(ids[:, :-1]), head_of(model), labels, reduction=reduction,
                                                label_smoothing=0.1, z_loss=1e-3, num_items_in_batch=count)
        return ((loss * weights).sum() if reduction == "none" else loss), metrics

    compiled_equals_eager(step, model, list(model.parameters()), backend, ids)


def plain_stats(model: TinyModel, ids: torch.Tensor, targets: torch.Tensor):
    """float64 materialized logits: ``(logp, lse, entropy, mean_logit)``, 0 at ignored targets."""
    with torch.no_grad():
        z = model.lm_head(model.hidden(ids)) / 0.7
        logq = torch.log_softmax(z, -1)
        keep = targets != -100
        logp = logq.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        out = (logp, torch.logsumexp(z, -1), -(logq.exp() * logq).sum(-1), z.mean(-1))
        return tuple(torch.where(keep, s, 0.0) for s in out)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_vocab_stats_compiled_equals_eager(seed, backend):
    """Every statistic, each with its own incoming gradient (the backward op's vector-Jacobian
    product); values also against float64 materialized logits."""
    model = TinyModel()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    targets = ids[:, 1:].masked_fill(torch.rand(B, T, generator=g) < 0.25, -100)
    w = torch.randn(4, B, T, generator=g, dtype=torch.float64)

    def step(model, ids):
        st = logitless.vocab_stats(model.hidden(ids[:, :-1]), head_of(model), targets, mean_logit=True)
        loss = sum((wi * s).sum() for wi, s in zip(w, st, strict=True))
        return loss, dict(zip(("logp", "lse", "entropy", "mean_logit"), st, strict=True))

    compiled_equals_eager(step, model, list(model.parameters()), backend, ids)
    _, metrics, _ = step_and_grads(torch.compile(step, backend=backend, fullgraph=True), model, [], ids)
    for got, want in zip(metrics.values(), plain_stats(model, ids[:, :-1], targets), strict=True):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_token_logprobs_compiled_equals_eager(seed, backend):
    """No gradient (as eager), whatever requires grad around it; values against float64 logits."""
    model = TinyModel()
    ids = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(seed))

    def step(model, ids):
        logp, entropy = logitless.token_logprobs(model.hidden(ids[:, :-1]), head_of(model), ids[:, 1:],
                                                 entropy=True)
        return logp.sum(), {"logp": logp, "entropy": entropy}

    compiled_equals_eager(step, model, list(model.parameters()), backend, ids)
    loss, metrics, _ = step_and_grads(torch.compile(step, backend=backend, fullgraph=True), model, [], ids)
    want = plain_stats(model, ids[:, :-1], ids[:, 1:])
    assert not loss.requires_grad
    assert torch.allclose(metrics["logp"], want[0], rtol=1e-12, atol=1e-12)
    assert torch.allclose(metrics["entropy"], want[2], rtol=1e-12, atol=1e-12)


def test_no_grad_compiled_equals_eager(seed):
    """Under ``torch.no_grad()`` the op takes no gradient (``needs`` all false) and the values are
    the eager ones."""
    model = TinyModel()
    x = policy_batch(seed)

    def step(model, x):
        return logitless.policy_loss(model.hidden(x["ids"][:, :-1]), head_of(model), x["ids"][:, 1:], x["mask"],
                                     x["adv"], x["old"], x["ref"], config=PolicyConfig(beta=0.04))

    with torch.no_grad():
        want = step(model, x)
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(model, x)
    assert not got[0].requires_grad
    assert_same((got[0], got[1], []), (want[0], want[1], []))


def test_autocast_and_a_head_built_inside(seed):
    """An fp32 model under bf16 autocast, its ``Head(weight, bias)`` built inside the compiled
    step: the head operands are cast in the graph as eagerly (``amp.autocast_head_inputs``), and
    loss, metrics and fp32 gradients equal eager's."""
    model = TinyModel().float()
    x = policy_batch(seed)

    def step(model, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.mix(model.embed(x["ids"][:, :-1]))  # bf16 out of the autocast Linear
            return logitless.policy_loss(h, Head(model.lm_head.weight, model.lm_head.bias), x["ids"][:, 1:],
                                         x["mask"], x["adv"], x["old"].float(), x["ref"].float(),
                                         config=PolicyConfig(beta=0.04))

    params = list(model.parameters())
    want = step_and_grads(step, model, params, x)
    got = step_and_grads(torch.compile(step, backend="aot_eager", fullgraph=True), model, params, x)
    assert all(g.dtype == torch.float32 for g in got[2])
    assert_same(got, want, tol=1e-6)  # fp32: AOTAutograd may round the backbone's backward otherwise


def test_bad_inputs_raise_the_eager_errors(seed):
    """Inside the compiled step the op's kernel runs eager validation: a bad shape or value raises
    eager's named ``ValueError`` when the step runs; a bad type runs eagerly behind a graph break
    and raises eager's ``TypeError`` there."""
    model = TinyModel()
    x = policy_batch(seed)

    def step(model, x, mask, config):
        return logitless.policy_loss(model.hidden(x["ids"][:, :-1]), head_of(model), x["ids"][:, 1:], mask, x["adv"],
                                     x["old"], x["ref"], config=config)[0]

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="completion_mask must have shape"):
        compiled(model, x, x["mask"][:, :-1], PolicyConfig())
    with pytest.raises(ValueError, match="completion_mask"):
        compiled(model, x, x["mask"] - 2, PolicyConfig())  # negative weights
    with pytest.raises(TypeError, match="PolicyConfig"):
        torch.compile(step, backend="aot_eager")(model, x, x["mask"], {"beta": 0.1})


# torch 2.11's dynamo with dynamic=True makes the float settings of a LogitTransform built inside
# the step symbolic, and cannot trace math.isfinite on them (graph break; fine from 2.13 on).
_OLD_DYNAMO = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)


@pytest.mark.parametrize("dynamic", [None, pytest.param(True, marks=pytest.mark.skipif(
    _OLD_DYNAMO, reason="torch < 2.13: dynamic=True cannot trace a LogitTransform built in the step"))])
def test_new_token_count(seed, dynamic):
    """Calls with other batch and token counts: with ``dynamic=None`` (the default) dynamo compiles
    once more at the second call, with the sizes dynamic (the fakes are shape-generic), then no
    more; with ``dynamic=True`` it compiles at the first call only. Every call equals eager."""
    model = TinyModel()
    params = list(model.parameters())
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(model, x):
        return logitless.policy_loss(model.hidden(x["ids"][:, :-1]), head_of(model), x["ids"][:, 1:], x["mask"],
                                     x["adv"], x["old"], x["ref"], config=PolicyConfig(beta=0.04))

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=dynamic)
    compiles = []
    for i, (b, t) in enumerate(((3, 7), (4, 5), (2, 11))):
        x = policy_batch(seed + i, b, t)
        assert_same(step_and_grads(compiled, model, params, x), step_and_grads(step, model, params, x))
        compiles.append(counter.frame_count)
    if dynamic is None:
        assert compiles == [1, 2, 2]
    else:  # (a restart while tracing the first call may count twice)
        assert compiles[0] >= 1 and compiles[1:] == [compiles[0]] * 2


def test_changing_count_compiles_once_more(seed):
    """A ``num_items_in_batch`` number that changes every step (it reaches the op as a tensor):
    one compile more, for the dynamic value, then none; every step equals eager."""
    model = TinyModel()
    x = policy_batch(seed)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(model, x, count):
        return logitless.policy_loss(model.hidden(x["ids"][:, :-1]), head_of(model), x["ids"][:, 1:], x["mask"],
                                     x["adv"], x["old"], x["ref"], config=PolicyConfig(loss_type="dapo"),
                                     num_items_in_batch=count)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    params = list(model.parameters())
    for count in (20, 31, 47, 52):
        assert_same(step_and_grads(compiled, model, params, x, count), step_and_grads(step, model, params, x, count))
    assert counter.frame_count == 2


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "vespo", "reinforce"])
def test_metric_names_are_the_eager_keys(seed, loss_type):
    """The fake implementation declares ``metric_names(config, sampler)``: they are eager's keys,
    in eager's order, for each loss type with and without KL, entropy bonus and sampler."""
    model = TinyModel()
    x = policy_batch(seed)
    for beta, bonus, sampler in ((0.0, 0.0, False), (0.04, 0.01, True)):
        cfg = PolicyConfig(loss_type=loss_type, beta=beta, entropy_coef=bonus)
        extra = {"sampling_logp": x["old"]} if sampler else {}
        if loss_type == "vespo":
            extra["importance_sampling_ratio"] = torch.ones(B, T, dtype=torch.float64)
        with torch.no_grad():
            _, metrics = logitless.policy_loss(model.hidden(x["ids"][:, :-1]), head_of(model), x["ids"][:, 1:],
                                               x["mask"], x["adv"], x["old"], x["ref"], config=cfg, **extra)
        assert tuple(metrics) == metric_names(cfg, sampler)


def test_ops_pass_opcheck(seed):
    """``torch.library.opcheck``: schema, fake implementation against the kernel (shapes, dtypes,
    strides), the registered autograd, and AOTAutograd with dynamic shapes, for each op."""
    from logitless.objectives import compiled

    model = TinyModel()
    x = policy_batch(seed)
    hidden = model.hidden(x["ids"][:, :-1]).detach().requires_grad_()
    w, b = model.lm_head.weight, model.lm_head.bias
    args = {"hidden": hidden, "head": Head(w, b), "options": None, "config": PolicyConfig(beta=0.04),
            "targets": x["ids"][:, 1:], "completion_mask": x["mask"], "advantages": x["adv"],
            "old_logp": x["old"], "ref_logp": x["ref"], "sampling_logp": x["old"]}
    tensors = {k: args[k] for k in ("targets", "completion_mask", "advantages", "old_logp", "ref_logp",
                                    "sampling_logp")}
    names = metric_names(args["config"], True)
    diff, others, text, numbers = compiled._inputs(
        "policy_loss", args, tensors, {"config": args["config"], "num_items_in_batch": None,
                                       "metrics": ",".join(names)})
    torch.library.opcheck(torch.ops.logitless.loss.default, (*diff, others, text, numbers, [True, True, True,
                                                                                           False, False]))
    values = {"ignore_index": -100, "entropy": True, "mean_logit": True, "outputs": "logp,lse,entropy,mean_logit",
              "metrics": ""}
    diff, others, text, numbers = compiled._inputs("vocab_stats", args, {"targets": args["targets"]}, values)
    torch.library.opcheck(torch.ops.logitless.token_stats.default, (*diff, others, text, numbers))


def test_encoded_arguments_round_trip():
    """Every field of the records and the scalars come back equal and of the same type."""
    from logitless.objectives import compiled

    values = {"config": PolicyConfig(loss_type="cispo", epsilon_high=5.0, delta=2, steps_per_generation=4,
                                     max_completion_length=9, training=False),
              "options": PassOptions(mode="recompute", chunk_bytes=2**40 + 3, logits_precision="input"),
              "transform": LogitTransform(temperature=0.7, logit_scale=1.5, softcap=30.0),
              "shard": logitless.VocabShard(vocab_start=3, vocab_size=40), "ignore_index": -100, "eps": 0.1,
              "flag": True, "none": None, "names": "kl,clip_ratio/low_mean"}
    text, numbers = compiled._encode(values)
    back = compiled._decode(text, tuple(numbers))
    assert back == values
    for name, value in values.items():
        got = back[name]
        assert type(got) is type(value), name
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                assert type(getattr(got, f.name)) is type(getattr(value, f.name)), (name, f.name)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_inductor_policy_loss_and_vocab_stats(seed):
    """The default backend (inductor, CPU): a step with both op families, against eager."""
    model = TinyModel()
    x = policy_batch(seed)

    def step(model, x):
        h = model.hidden(x["ids"][:, :-1])
        loss, metrics = logitless.policy_loss(h, head_of(model), x["ids"][:, 1:], x["mask"], x["adv"], x["old"],
                                              x["ref"], config=PolicyConfig(beta=0.04))
        st = logitless.vocab_stats(h, head_of(model), x["ids"][:, 1:])
        return loss + 0.1 * st.entropy.mean(), metrics

    params = list(model.parameters())
    compiled_equals_eager(step, model, params, "inductor", x)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_cuda_inductor_and_cuda_graphs_equal_eager(seed, mode):
    """On the GPU: the default backend, bf16 head and hidden states, the default kernels, also
    with CUDA graphs (``mode="reduce-overhead"``: the ops are tagged ``cudagraph_unsafe``, so
    inductor leaves them out of the graphs it captures). Three steps with new inputs, each equal
    to eager: the hidden states are a leaf, so the step is the two ops and a sum (incoming
    gradients of exactly 1); allowed: one bf16 rounding of the gradients (2^-8 relative)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    v, h, b, t = 32011, 512, 4, 256
    weight = (0.05 * torch.randn(v, h, device="cuda", generator=g)).bfloat16().requires_grad_()

    def step(_, hidden, weight, x):
        loss, metrics = logitless.policy_loss(hidden, Head(weight), x["ids"], x["mask"], x["adv"], x["old"],
                                              config=PolicyConfig(loss_type="dapo", epsilon_high=0.28))
        st = logitless.vocab_stats(hidden, Head(weight), x["ids"])
        return loss + st.entropy.sum(), metrics

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for _ in range(3):
        hidden = torch.randn(b, t, h, device="cuda", generator=g).bfloat16().requires_grad_()
        x = {"ids": torch.randint(0, v, (b, t), device="cuda", generator=g),
             "mask": (torch.rand(b, t, device="cuda", generator=g) > 0.2).long(),
             "adv": torch.randn(b, device="cuda", generator=g), "old": -torch.rand(b, t, device="cuda", generator=g)}
        want = step_and_grads(step, None, [hidden, weight], hidden, weight, x)
        got = step_and_grads(compiled, None, [hidden, weight], hidden, weight, x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
        assert list(got[1]) == list(want[1])
        for k in want[1]:
            torch.testing.assert_close(got[1][k], want[1][k], rtol=1e-6, atol=1e-7, equal_nan=True)
        for gr, w in zip(got[2], want[2], strict=True):
            assert ((gr.float() - w.float()).norm() / w.float().norm()).item() <= 2**-8
