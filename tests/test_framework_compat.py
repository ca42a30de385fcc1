"""logitless under PyTorch's training-framework features: torch.compile, gradient accumulation,
autocast, no_grad / inference_mode, GradScaler and activation checkpointing.

Every test compares values and gradients with the plain path (materialized logits
``hidden @ W.T + b``, ``log_softmax``, the same loss formula written out here), in float64 unless
the feature itself sets the precision (autocast), and, where the feature must not change the
computation, with the same logitless call without the feature.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import logitless
from logitless import Head, LogitTransform, PassOptions, PolicyConfig

V, H, B, T = 37, 16, 4, 6  # odd vocabulary; B even so the batch splits into two micro-batches
TEMP = 0.7
MODES = ("fused", "recompute")
CFG = PolicyConfig(loss_type="dapo", beta=0.04, epsilon_high=0.28)
TRANSFORM = LogitTransform(temperature=TEMP)

# fp32 logitless on an fp32 model against the float64 plain path: a few fp32 ulps through the
# backbone, GEMMs of length H = 16 / V = 37 and the softmax give ~1e-7 relative; 1e-5 leaves a
# margin and is still far below any semantic error (a wrong normalizer, scale, or a token counted
# twice or not at all moves the loss or a gradient by >= 1e-2).
F64_TOL = 1e-5
# A feature that must not change what is computed (compile with the eager / aot_eager backends,
# checkpointing, no_grad, a split batch): the same fp32 kernels, at most another summation order
# of a few terms (e.g. d weight over two micro-batches): fp32 roundoff, ~1e-7.
SAME_TOL = 1e-6


# ----------------------------------------------------------------------------- helpers


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def flat_grads(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


class TinyLM(nn.Module):
    """Embedding -> Linear -> tanh -> residual -> Linear, and an ``lm_head`` with a bias. The
    backbone ends in a Linear so that under autocast its hidden states come out in bf16 while
    the head's parameters stay fp32 (the mixed case autocast creates)."""

    def __init__(self, seed: int, bias: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        self.out = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=bias)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.4 if p.dim() > 1 else 0.2))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, H]
        e = self.embed(x)
        return self.out(torch.tanh(self.mix(e)) + e)

    def forward(self, x, ids, mask, adv, old, ref, mode: str) -> torch.Tensor:
        """The training loss through logitless: what ``torch.compile`` wraps."""
        return ours_loss(self.hidden(x), self.lm_head.weight, self.lm_head.bias, Batch(ids, mask, adv, old, ref), mode)


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] sampled completion tokens
    mask: torch.Tensor  # [B, T]
    adv: torch.Tensor  # [B]
    old: torch.Tensor  # [B, T]
    ref: torch.Tensor  # [B, T]

    def rows(self, sl: slice) -> Batch:
        return Batch(self.ids[sl], self.mask[sl], self.adv[sl], self.old[sl], self.ref[sl])

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.mask, self.adv, self.old, self.ref


def make_batch(seed: int, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Batch:
    """Random tokens, a ragged mask (every row keeps tokens), advantages, and old / reference
    log-probs near the head's current ones so that both clip sides and the KL act."""
    g = torch.Generator().manual_seed(seed)
    b, t = hidden.shape[:2]
    ids = torch.randint(0, V, (b, t), generator=g)
    with torch.no_grad():
        now = plain_logp(hidden.double(), weight.double(), None if bias is None else bias.double(), ids,
                         torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    mask[:, 0] = 1
    return Batch(ids=ids, mask=mask, adv=torch.randn(b, generator=g),
                 old=(now + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).float(),
                 ref=(now + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).float())


def batch_for(model: TinyLM, x: torch.Tensor, seed: int) -> Batch:
    return make_batch(seed, model.hidden(x), model.lm_head.weight, model.lm_head.bias)


def inputs(seed: int, b: int = B) -> torch.Tensor:
    return torch.randint(0, V, (b, T), generator=torch.Generator().manual_seed(seed))


def ours_loss(hidden, weight, bias, batch: Batch, mode: str, cfg: PolicyConfig = CFG, num_items=None) -> torch.Tensor:
    loss, _ = logitless.policy_loss(hidden, Head(weight, bias=bias, transform=TRANSFORM), batch.ids, batch.mask,
                                    batch.adv, batch.old, batch.ref, config=cfg, num_items_in_batch=num_items,
                                    options=PassOptions(mode=mode))
    return loss


def plain_logp(hidden, weight, bias, ids, dtype: torch.dtype, temperature: float = TEMP) -> torch.Tensor:
    """The model's own head: ``F.linear`` (autocast applies to it as to ``nn.Linear``), then the
    log-softmax in ``dtype``."""
    logits = F.linear(hidden, weight, bias)
    return torch.log_softmax(logits.to(dtype) / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def plain_policy(logp: torch.Tensor, batch: Batch, cfg: PolicyConfig = CFG, num_items=None) -> torch.Tensor:
    """TRL 1.16 ``GRPOTrainer._compute_loss`` at token level for ``dapo`` / ``dr_grpo``: clipped
    surrogate, k3 KL with the ratio's bias correction, the loss type's normalizer."""
    dt = logp.dtype
    old, ref, adv, m = batch.old.to(dt), batch.ref.to(dt), batch.adv.to(dt)[:, None], batch.mask.to(dt)
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + cfg.eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if cfg.beta:
        d = ref - logp
        per_token = per_token + cfg.beta * (torch.exp(d) - d - 1) * coef_1
    g = cfg.gradient_accumulation_steps
    if cfg.loss_type == "dapo":
        denom = m.sum() if num_items is None else torch.as_tensor(float(num_items), dtype=dt)
        return (per_token * m).sum() / denom
    assert cfg.loss_type == "dr_grpo"
    return (per_token * m).sum() / (logp.shape[0] * logp.shape[1]) / g


def plain_model_loss(model: TinyLM, x, batch: Batch, cfg: PolicyConfig = CFG, num_items=None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    h = model.hidden(x)
    return plain_policy(plain_logp(h, model.lm_head.weight, model.lm_head.bias, batch.ids, dtype), batch, cfg,
                        num_items)


def f64_reference(model: TinyLM, x, batch: Batch, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and flat parameter gradients of the plain path on a float64 copy of ``model``."""
    m64 = copy.deepcopy(model).double()
    m64.zero_grad(set_to_none=True)
    loss = plain_model_loss(m64, x, batch, **kw)
    loss.backward()
    return loss.detach(), flat_grads(m64.parameters())


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own functions; leftover caches would only add recompilations."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("mode", MODES)
def test_compile_model_calling_policy_loss(mode, backend):
    """A module whose forward calls ``policy_loss``, compiled (the backends that need no C++
    compiler): the backbone and logitless's custom op in one graph; loss and every parameter
    gradient equal the eager module's and the float64 plain path's."""
    model = TinyLM(seed=1)
    x = inputs(2)
    batch = batch_for(model, x, seed=3)
    eager = model(x, *batch.args(), mode)
    eager.backward()
    g_eager = flat_grads(model.parameters())
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend=backend)
    loss = compiled(x, *batch.args(), mode)
    loss.backward()
    g = flat_grads(model.parameters())
    ref_loss, ref_g = f64_reference(model, x, batch)
    assert rel_err(loss, eager) <= SAME_TOL and rel_err(g, g_eager) <= SAME_TOL
    assert rel_err(loss, ref_loss) <= F64_TOL and rel_err(g, ref_g) <= F64_TOL


@pytest.mark.parametrize("mode", MODES)
def test_compile_two_calls_in_one_graph(mode):
    """A function that calls ``policy_loss`` twice, compiled with ``fullgraph=True``: one graph, no
    break, each call one ``logitless::loss`` custom op (dynamo never traces into the pass), and the
    compiled loss/gradients equal the eager and the float64 plain ones."""
    model = TinyLM(seed=4)
    x = inputs(5)
    batch = batch_for(model, x, seed=6)
    drgrpo = PolicyConfig(loss_type="dr_grpo", beta=0.0)

    def two_losses(model, x, batch, dtype=None):  # dtype: the plain path in that dtype
        h = model.hidden(x)
        w, b = model.lm_head.weight, model.lm_head.bias
        if dtype is not None:
            return plain_policy(plain_logp(h, w, b, batch.ids, dtype), batch) + 0.5 * plain_policy(
                plain_logp(torch.tanh(h), w, b, batch.ids, dtype), batch, drgrpo)
        return ours_loss(h, w, b, batch, mode) + 0.5 * ours_loss(torch.tanh(h), w, b, batch, mode, drgrpo)

    explained = torch._dynamo.explain(two_losses)(model, x, batch)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    ops = [n for n in explained.graphs[0].graph.nodes if str(n.target).startswith("logitless.loss")]
    assert len(ops) == 2

    eager = two_losses(model, x, batch)
    eager.backward()
    g_eager = flat_grads(model.parameters())
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    loss = torch.compile(two_losses, backend="aot_eager", fullgraph=True)(model, x, batch)
    loss.backward()
    g = flat_grads(model.parameters())
    m64 = copy.deepcopy(model).double()
    ref = two_losses(m64, x, batch, dtype=torch.float64)
    ref.backward()
    assert rel_err(loss, eager) <= SAME_TOL and rel_err(g, g_eager) <= SAME_TOL
    assert rel_err(loss, ref) <= F64_TOL and rel_err(g, flat_grads(m64.parameters())) <= F64_TOL


def test_compile_call_without_op_breaks_graph_with_reason():
    """A call the custom ops cannot take (here a LoRA adapter with dropout, a Python callable)
    runs eagerly behind one graph break: ``fullgraph=True`` fails at compile time, before any
    kernel runs, with dynamo's ``Unsupported`` naming our reason; ``fullgraph=False`` gives the
    eager loss and gradients."""
    model = TinyLM(seed=7)
    x = inputs(8)
    batch = batch_for(model, x, seed=9)
    a = (0.1 * torch.randn(2, H, generator=torch.Generator().manual_seed(1))).requires_grad_()
    b = (0.1 * torch.randn(V, 2, generator=torch.Generator().manual_seed(2))).requires_grad_()

    def loss_fn(model, x):
        head = Head(model.lm_head.weight, bias=model.lm_head.bias, transform=TRANSFORM,
                    lora=logitless.HeadLoRA(a, b, scaling=2.0, dropout=nn.Identity()))
        return logitless.policy_loss(model.hidden(x), head, *batch.args(), config=CFG)[0]

    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"torch\.compiler\.disable"):
        torch.compile(loss_fn, backend="eager", fullgraph=True)(model, x)
    eager = loss_fn(model, x)
    eager.backward()
    g_eager = torch.cat([flat_grads(model.parameters()), a.grad.reshape(-1), b.grad.reshape(-1)])
    model.zero_grad(set_to_none=True)
    a.grad = b.grad = None
    explained = torch._dynamo.explain(loss_fn)(model, x)
    # One break, ours (dynamo counts a break that ends the traced frame in break_reasons only).
    assert len(explained.break_reasons) == 1 and "no compiled path" in str(explained.break_reasons[0].reason)
    torch._dynamo.reset()
    loss = torch.compile(loss_fn, backend="aot_eager")(model, x)
    loss.backward()
    g = torch.cat([flat_grads(model.parameters()), a.grad.reshape(-1), b.grad.reshape(-1)])
    assert rel_err(loss, eager) <= SAME_TOL and rel_err(g, g_eager) <= SAME_TOL


@pytest.mark.parametrize("mode", MODES)
def test_compile_cross_entropy(mode):
    """``cross_entropy`` (label smoothing and z-loss) inside a compiled function, against
    ``F.cross_entropy`` on float64 logits plus the z-loss written out."""
    model = TinyLM(seed=10)
    x = inputs(11)
    labels = inputs(12).masked_fill(inputs(13) % 5 == 0, -100)

    def ce(model, x):
        loss, _ = logitless.cross_entropy(model.hidden(x), Head(model.lm_head.weight, bias=model.lm_head.bias), labels,
                                          label_smoothing=0.1, z_loss=1e-3, options=PassOptions(mode=mode))
        return loss

    loss = torch.compile(ce, backend="aot_eager")(model, x)
    loss.backward()
    m64 = copy.deepcopy(model).double()
    logits = m64.lm_head(m64.hidden(x)).reshape(-1, V)
    keep = labels.reshape(-1) != -100
    ref = F.cross_entropy(logits, labels.reshape(-1), label_smoothing=0.1) \
        + 1e-3 * (torch.logsumexp(logits[keep], -1) ** 2).mean()
    ref.backward()
    assert rel_err(loss, ref) <= F64_TOL
    assert rel_err(flat_grads(model.parameters()), flat_grads(m64.parameters())) <= F64_TOL


def test_compile_hf_llama_backbone():
    """A tiny transformers Llama compiled with aot_eager, its backbone's hidden states into
    ``policy_loss`` with its ``lm_head``: same loss and parameter gradients as eager and as the
    float64 model's own logits (``model(...).logits``) through the plain loss, in both modes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(14)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    prompt = 3
    ids = torch.randint(0, V, (B, prompt + T), generator=torch.Generator().manual_seed(15))
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        h64 = m64.model(input_ids=ids).last_hidden_state[:, prompt - 1:-1]
    batch = make_batch(16, h64, m64.lm_head.weight, None)

    def step(ids):
        h = model.model(input_ids=ids).last_hidden_state[:, prompt - 1:-1]
        return ours_loss(h, model.lm_head.weight, None, batch, mode)

    logits64 = m64(input_ids=ids).logits[:, prompt - 1:-1]
    ref = plain_policy(torch.log_softmax(logits64 / TEMP, -1).gather(-1, batch.ids[..., None]).squeeze(-1), batch)
    ref.backward()
    ref_g = torch.cat([p.grad.reshape(-1) for p in m64.parameters()])
    for mode in MODES:
        model.zero_grad(set_to_none=True)
        eager = step(ids)
        eager.backward()
        g_eager = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        loss = torch.compile(step, backend="aot_eager")(ids)
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        assert rel_err(loss, eager) <= SAME_TOL and rel_err(g, g_eager) <= SAME_TOL, mode
        assert rel_err(loss, ref) <= F64_TOL and rel_err(g, ref_g) <= F64_TOL, mode


def test_entry_points_keep_signature_and_docstring():
    """The compile-route, graph-break and autocast decorators are transparent to introspection
    (help(), IDEs, ``inspect.signature``)."""
    for name in ("policy_loss", "cross_entropy", "head_loss", "vocab_stats", "token_logprobs", "sequence_logps",
                 "distill_loss"):
        fn = getattr(logitless, name)
        inner = inspect.unwrap(fn)
        assert fn.__name__ == name and fn.__doc__ and fn.__doc__ == inner.__doc__, name
        assert inspect.signature(fn) == inspect.signature(inner), name
        assert next(iter(inspect.signature(fn).parameters)) == "hidden", name


# ----------------------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", ["dr_grpo", "dapo"])
def test_gradient_accumulation_equals_full_batch(mode, loss_type):
    """Two micro-batches, ``backward()`` on each, gradients summed in ``.grad``: equal to one
    call on the whole batch. Exact only where the micro-batch losses add up to the full loss:
    dr_grpo divides by ``rows x T`` (``max_completion_length``), so each half-batch loss is twice
    its share and the loop's usual ``loss / 2`` restores it; dapo with ``num_items_in_batch``
    set to the whole batch's token count (TRL's / HF's convention) already gives each micro-batch
    its share, so nothing is divided. Gradients reach a leaf ``hidden`` (rows of one tensor, so
    both halves accumulate into it), the head weight and its bias."""
    g = torch.Generator().manual_seed(17)
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    head = TinyLM(seed=18).lm_head
    batch = make_batch(19, hidden, head.weight, head.bias)
    cfg = PolicyConfig(loss_type=loss_type, beta=0.04)
    n_items = int(batch.mask.sum())
    num_items, div = (None, 2.0) if loss_type == "dr_grpo" else (n_items, 1.0)
    params = [hidden, head.weight, head.bias]

    full = ours_loss(hidden, head.weight, head.bias, batch, mode, cfg, num_items)
    full.backward()
    g_full = flat_grads(params)
    for p in params:
        p.grad = None
    total = 0.0
    for sl in (slice(0, B // 2), slice(B // 2, B)):
        loss = ours_loss(hidden[sl], head.weight, head.bias, batch.rows(sl), mode, cfg, num_items) / div
        loss.backward()
        total = total + loss.detach()
    g_acc = flat_grads(params)

    p64 = [p.detach().double().requires_grad_() for p in params]
    ref = plain_policy(plain_logp(*p64, batch.ids, torch.float64), batch, cfg, num_items)
    ref.backward()
    assert rel_err(total, full) <= SAME_TOL and rel_err(g_acc, g_full) <= SAME_TOL
    assert rel_err(total, ref) <= F64_TOL and rel_err(g_acc, flat_grads(p64)) <= F64_TOL


# ----------------------------------------------------------------------------- autocast

# One bf16 rounding of a result computed in fp32 from bf16 operands: the bound for what logitless
# returns in bf16 (d hidden, and d weight / d bias cast to the dtype of their bf16 operand copies)
# against float64 on the same bf16 operands. bf16 keeps 8 significant bits: a rounding moves a value
# by at most 2^-8 of itself; the fp32 accumulation before it adds ~1e-7 (the absolute term).
# Operands not rounded to bf16 (an fp32 head) would miss the loss check by ~1e-3.
BF16_ROUND = 2.0**-8
# logitless against the plain path under the same autocast: both take bf16 operands, but the plain
# path also rounds the logits to bf16 (~1e-2 absolute at |z| ~ 3) and runs the head's backward GEMMs
# in bf16; measured 1.4e-3 (loss) and 4.5e-3 (gradients) here, bounded at 2e-2.
BF16_PLAIN_TOL = 2e-2


@pytest.mark.parametrize("mode", MODES)
def test_autocast_bf16_computes_like_the_models_head(mode):
    """fp32 model under ``torch.autocast("cpu", bfloat16)``: the backbone hands over bf16 hidden
    states, the head weight and bias are fp32. logitless must take the same bf16 operands as
    the model's own ``lm_head`` would (before the fix this mixed-dtype call raised TypeError),
    keep fp32 statistics, and return fp32 gradients to the fp32 parameters.
    Checked against (a) float64 math on the bf16-rounded operands: tight, it pins the operand
    dtype; (b) the plain path under the same autocast: bf16 tolerance, for the model params."""
    model = TinyLM(seed=20)
    x = inputs(21)
    batch = batch_for(model, x, seed=22)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.hidden(x)
        h.retain_grad()
        assert h.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32
        loss = ours_loss(h, model.lm_head.weight, model.lm_head.bias, batch, mode)
    loss.backward()
    assert loss.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    g_ours = flat_grads(model.parameters())

    # (a) the head's operands rounded to bf16, everything after them in float64
    h64 = h.detach().double().requires_grad_()
    w64 = model.lm_head.weight.detach().bfloat16().double().requires_grad_()
    b64 = model.lm_head.bias.detach().bfloat16().double().requires_grad_()
    ref = plain_policy(plain_logp(h64, w64, b64, batch.ids, torch.float64), batch)
    ref.backward()
    assert rel_err(loss, ref) <= F64_TOL
    for ours, exact in ((h.grad, h64.grad), (model.lm_head.weight.grad, w64.grad), (model.lm_head.bias.grad, b64.grad)):
        err = (ours.double() - exact).abs()
        assert (err <= BF16_ROUND * exact.abs() + 1e-6 * exact.abs().max()).all()

    # (b) the model's own head under the same autocast
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = plain_model_loss(model, x, batch, dtype=torch.float32)
    plain.backward()
    assert rel_err(loss, plain) <= BF16_PLAIN_TOL
    assert rel_err(g_ours, flat_grads(model.parameters())) <= BF16_PLAIN_TOL


def test_autocast_fp32_operands_and_other_entry_points():
    """fp32 hidden and weight under autocast (e.g. a Llama residual stream): cast to bf16 like
    ``nn.Linear``; ``cross_entropy``, ``vocab_stats`` and ``token_logprobs`` follow the same rule;
    float64 inputs are left alone, as autocast leaves them; without autocast nothing is cast."""
    g = torch.Generator().manual_seed(23)
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = (0.4 * torch.randn(V, H, generator=g)).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    h_bf, w_bf = hidden.detach().bfloat16().double(), weight.detach().bfloat16().double()
    logp_bf = torch.log_softmax(h_bf @ w_bf.T, -1).gather(-1, labels[..., None]).squeeze(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = logitless.token_logprobs(hidden, weight, labels)
        st = logitless.vocab_stats(hidden, weight, labels)
        ce, _ = logitless.cross_entropy(hidden, weight, labels)
        lp64 = logitless.token_logprobs(hidden.double(), weight.double(), labels)
    for got in (lp, st.logp):
        assert got.dtype == torch.float32 and rel_err(got, logp_bf) <= F64_TOL
    assert rel_err(ce, -logp_bf.mean()) <= F64_TOL
    ce.backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    exact = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert lp64.dtype == torch.float64 and rel_err(lp64, exact) <= 1e-12
    fp32 = logitless.token_logprobs(hidden, weight, labels)  # no autocast: fp32 operands
    assert rel_err(fp32, exact) <= F64_TOL < rel_err(lp, exact)


# ----------------------------------------------------------------------------- no_grad / inference_mode


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("mode", MODES)
def test_no_grad_and_inference_mode(ctx, mode):
    """Inputs that require grad, called under ``no_grad`` / ``inference_mode``: no error, no
    graph (``requires_grad`` False, no ``grad_fn``), and the same values as with grad, which
    equal the float64 plain path."""
    model = TinyLM(seed=24)
    x = inputs(25)
    batch = batch_for(model, x, seed=26)
    h = model.hidden(x).detach().requires_grad_()
    w, b = model.lm_head.weight, model.lm_head.bias
    head = Head(w, bias=b, transform=TRANSFORM)

    def run():
        loss, metrics = logitless.policy_loss(h, head, batch.ids, batch.mask, batch.adv,
                                              batch.old, batch.ref, config=CFG, options=PassOptions(mode=mode))
        st = logitless.vocab_stats(h, head, batch.ids)
        lp, ent = logitless.token_logprobs(h, head, batch.ids, entropy=True)
        return [loss, metrics["entropy"], metrics["kl"], st.logp, st.lse, st.entropy, lp, ent]

    with_grad = run()
    assert with_grad[0].requires_grad and with_grad[3].requires_grad
    with ctx():
        without = run()
    for a, ref in zip(without, with_grad, strict=True):
        assert not a.requires_grad and a.grad_fn is None
        assert rel_err(a, ref) <= SAME_TOL
        if ctx is torch.inference_mode:
            assert a.is_inference()
    h64, w64, b64 = h.detach().double(), w.detach().double(), b.detach().double()
    logits = (h64 @ w64.T + b64) / TEMP
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, batch.ids[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    assert rel_err(without[0], plain_policy(logp, batch)) <= F64_TOL
    for a, exact in ((without[3], logp), (without[4], torch.logsumexp(logits, -1)), (without[5], entropy),
                     (without[6], logp), (without[7], entropy)):
        assert rel_err(a, exact) <= F64_TOL
    assert h.grad is None and w.grad is None


# ----------------------------------------------------------------------------- GradScaler, grad_output


def _grad_scaler():
    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip("this torch has no torch.amp.GradScaler")
    try:
        return torch.amp.GradScaler("cpu", init_scale=2.0**16)
    except (RuntimeError, ValueError, TypeError) as e:
        pytest.skip(f"torch.amp.GradScaler('cpu') unavailable: {e}")


@pytest.mark.parametrize("mode", MODES)
def test_grad_scaler_unscale_matches_unscaled(mode):
    """``scaler.scale(loss).backward()`` then ``unscale_``: the fused backward multiplies its
    saved gradients by the incoming 65536, recompute propagates it through the statistics.
    A power-of-two scale and its inverse are exact in fp32, so the unscaled gradients equal
    the plain ``backward()`` ones to roundoff; no inf is found, the step equals plain SGD's."""
    scaler = _grad_scaler()
    model = TinyLM(seed=27)
    x = inputs(28)
    batch = batch_for(model, x, seed=29)
    model(x, *batch.args(), mode).backward()
    g_plain = flat_grads(model.parameters())
    _, ref_g = f64_reference(model, x, batch)
    stepped = copy.deepcopy(model)
    for p, q in zip(model.parameters(), stepped.parameters(), strict=True):
        q.grad = p.grad.clone()
    torch.optim.SGD(stepped.parameters(), lr=0.1).step()

    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(x, *batch.args(), mode)).backward()
    assert rel_err(flat_grads(model.parameters()), 2.0**16 * g_plain) <= SAME_TOL
    scaler.unscale_(opt)
    g = flat_grads(model.parameters())
    assert rel_err(g, g_plain) <= SAME_TOL and rel_err(g, ref_g) <= F64_TOL
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**16  # no inf/NaN found, no backoff
    for p, q in zip(model.parameters(), stepped.parameters(), strict=True):
        assert rel_err(p, q) <= SAME_TOL


@pytest.mark.parametrize("mode", MODES)
def test_non_unit_grad_output_and_retained_graph(mode):
    """``(loss * 3.7).backward()``, ``autograd.grad`` with ``grad_outputs=-0.25``, and two
    backward calls through one retained graph (the fused backward returns its saved buffers:
    they must not be aliased into ``.grad`` and doubled): gradients scale exactly as the
    float64 plain path's."""
    model = TinyLM(seed=30)
    x = inputs(31)
    batch = batch_for(model, x, seed=32)
    params = list(model.parameters())
    _, ref_g = f64_reference(model, x, batch)

    (model(x, *batch.args(), mode) * 3.7).backward()
    assert rel_err(flat_grads(params), 3.7 * ref_g) <= F64_TOL
    model.zero_grad(set_to_none=True)

    loss = model(x, *batch.args(), mode)
    grads = torch.autograd.grad(loss, params, grad_outputs=torch.tensor(-0.25), retain_graph=True)
    assert rel_err(torch.cat([g.reshape(-1) for g in grads]), -0.25 * ref_g) <= F64_TOL
    for _ in range(3):
        loss.backward(retain_graph=True)
    assert rel_err(flat_grads(params), 3 * ref_g) <= F64_TOL


# ----------------------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_activation_checkpointing_around_the_head(mode, reentrant):
    """``checkpoint(fn, hidden)`` with ``fn`` calling ``policy_loss``: nothing of the pass is
    kept, it runs again in backward (the fused mode computes its gradients in that rerun;
    non-reentrant runs the fused forward with grad, reentrant without). Loss and the gradients
    of every parameter (backbone through ``hidden``, head directly) equal the call without
    checkpointing and the float64 plain path."""
    model = TinyLM(seed=33)
    x = inputs(34)
    batch = batch_for(model, x, seed=35)
    head = model.lm_head

    def fn(h):
        return ours_loss(h, head.weight, head.bias, batch, mode)

    plain = fn(model.hidden(x))
    plain.backward()
    g_plain = flat_grads(model.parameters())
    model.zero_grad(set_to_none=True)
    loss = checkpoint(fn, model.hidden(x), use_reentrant=reentrant)
    loss.backward()
    g = flat_grads(model.parameters())
    ref_loss, ref_g = f64_reference(model, x, batch)
    assert rel_err(loss, plain) <= SAME_TOL and rel_err(g, g_plain) <= SAME_TOL
    assert rel_err(loss, ref_loss) <= F64_TOL and rel_err(g, ref_g) <= F64_TOL
