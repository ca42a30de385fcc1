"""FSDP2 (``fully_shard``) models through find_head / head_inputs, 2 gloo ranks on CPU: one GRPO
step's loss, metrics and every parameter's gradient (after FSDP's reduce-scatter) equal a
single-process oracle on both ranks' data (TRL's own ``_compute_loss`` on materialized float64
logits), whether FSDP holds the head unsharded (root group), sharded (``lm_head`` sharded on its
own, or the root resharding after forward) or tied to the embeddings in one group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from logitless import PassOptions

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import this module by name
from gloo_ranks import run_ranks

if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

WORLD = 2
B, PROMPT, COMPLETION, V = 4, 4, 6, 64
# How the head is sharded (see _shard). FSDP holds it sharded when the loss runs in the
# SHARDED ones: their head group does not run forward, or reshards after it.
VARIANTS = ("root", "tail", "tied_tail", "head", "root_reshard", "tied", "mixed")
TIED = ("tied_tail", "tied")
SHARDED = ("head", "root_reshard", "tied", "mixed")
CFG = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28)


def _tiny_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    with torch.no_grad():  # an untrained head is near uniform; make the softmax matter
        model.lm_head.weight.normal_(0.0, 1.0)
    return model


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, PROMPT + COMPLETION), generator=gen)
    mask = (torch.rand(B, COMPLETION, generator=gen) > 0.2).to(torch.float64)
    mask[:, 0] = 1.0
    return dict(ids=ids, mask=mask, advantages=torch.randn(B, generator=gen, dtype=torch.float64),
                old_shift=0.3 * torch.randn(B, COMPLETION, generator=gen, dtype=torch.float64),
                ref_shift=0.3 * torch.randn(B, COMPLETION, generator=gen, dtype=torch.float64))


def _oracle(tie: bool, data: dict):
    """TRL's own ``_compute_loss`` (tests/trl_oracle.py) on the materialized float64 logits of the
    unsharded model, one process, the whole batch: its loss, every parameter's gradient, and its
    metrics (with 2 processes TRL gathers the same values)."""
    from trl_oracle import trl_grpo_loss

    model = _tiny_llama(tie)
    hidden = model.model(input_ids=data["ids"]).last_hidden_state[:, PROMPT - 1:-1]
    weight, targets = model.lm_head.weight, data["ids"][:, PROMPT:]
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    old, ref = logp + data["old_shift"], logp + data["ref_shift"]
    loss, metrics = trl_grpo_loss(hidden, weight, targets, data["mask"], data["advantages"], old, ref,
                                  max_completion_length=COMPLETION, **CFG)
    loss.backward()
    return (loss.detach(), logp, old, ref,
            {n: p.grad for n, p in model.named_parameters()}, metrics)


def _shard(model, variant: str, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # fp32 gathers, compute and gradient reduce-scatter over fp64 shards
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.float32) if variant == "mixed" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    if variant in ("head", "mixed"):
        fully_shard(model.lm_head, mesh=mesh, mp_policy=mp_policy)
    elif variant == "tied":
        # FSDP2 needs a tied weight's modules in one group (its duplicate-parameter check)
        fully_shard([model.model.embed_tokens, model.lm_head], mesh=mesh)
    elif variant in ("tail", "tied_tail"):
        # accelerate 1.15's FSDP2 layout (utils/fsdp_utils.py): final norm + head (+ tied
        # embeddings) in one group that stays unsharded after forward
        tail = [model.model.norm, model.model.embed_tokens, model.lm_head] if variant == "tied_tail" else \
            [model.model.norm, model.lm_head]
        fully_shard(tail, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=True if variant == "root_reshard" else None,
                mp_policy=mp_policy)


def _rank_step(rank: int, world: int, case: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from logitless import PolicyConfig, policy_loss, token_logprobs
    from logitless.model_heads import UnsupportedModelError, add_hidden_states_forward, find_head, head_inputs

    mesh = init_device_mesh("cpu", (world,))
    per = B // world
    sl = slice(rank * per, (rank + 1) * per)
    ids = case["data"]["ids"][sl]
    mask = case["data"]["mask"][sl]
    out = {}
    for variant in VARIANTS:
        model = _tiny_llama(tie=variant in TIED)
        if variant == "head":
            add_hidden_states_forward(model)  # patched before sharding here, after it below
        _shard(model, variant, mesh)
        add_hidden_states_forward(model)
        o = case["oracle"][variant in TIED]
        # Rollout side (no grad): a copy of the gathered head, FSDP's registration left as found.
        with torch.no_grad():
            hidden = model(input_ids=ids, logitless_hidden_states=True)[:, PROMPT - 1:-1]
            before = type(model.lm_head.weight)
            h, ready = head_inputs(hidden, find_head(model))
            rollout_logp = token_logprobs(h, ready, ids[:, PROMPT:], options=PassOptions(impl="torch"))
            assert type(model.lm_head.weight) is before, variant
        # Training step.
        hidden = model(input_ids=ids, logitless_hidden_states=True)[:, PROMPT - 1:-1]
        head = find_head(model)
        sharded_at_loss = isinstance(head.weight, DTensor)
        if variant == "head":
            with pytest.raises(UnsupportedModelError, match="do not require grad"):
                head_inputs(hidden.detach(), head)
        h, ready = head_inputs(hidden, head)
        assert not isinstance(ready.weight, DTensor)
        assert ready.weight.dtype == (torch.float32 if variant == "mixed" else torch.float64)  # FSDP's param_dtype
        cfg = PolicyConfig(**CFG, num_processes=world)
        loss, metrics = policy_loss(h, ready, ids[:, PROMPT:], mask, case["data"]["advantages"][sl], o["old"][sl],
                              o["ref"][sl], config=cfg, num_items_in_batch=case["data"]["mask"].sum(),
                              group=dist.group.WORLD, options=PassOptions(impl="torch"))
        loss.backward()
        out[variant] = dict(
            loss=loss.detach(), metrics={k: v.item() for k, v in metrics.items()}, rollout_logp=rollout_logp,
            sharded_at_loss=sharded_at_loss,
            resharded_after=isinstance(model.lm_head.weight, DTensor),
            grads={n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()})
    # A DTensor head no FSDP module manages (tensor parallel) is refused, not gathered.
    model = _tiny_llama(tie=False)
    model.lm_head.weight = torch.nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(UnsupportedModelError, match="no FSDP2"):
        find_head(model)
    return out


def _spawn(case: dict) -> list[dict]:
    return run_ranks(_rank_step, WORLD, case, timeout_s=240)


def test_fsdp2_grpo_step_matches_single_process():
    pytest.importorskip("transformers")
    data = _batch()
    oracle = {}
    for tie in (False, True):
        loss, logp, old, ref, grads, metrics = _oracle(tie, data)
        oracle[tie] = dict(loss=loss, logp=logp, old=old, ref=ref, grads=grads, metrics=metrics)
    outs = _spawn(dict(data=data, oracle={t: {k: oracle[t][k] for k in ("old", "ref")} for t in oracle}))
    per = B // WORLD
    for variant in VARIANTS:
        o = oracle[variant in TIED]
        res = [r[variant] for r in outs]
        tol = dict(rtol=1e-3, atol=5e-5) if variant == "mixed" else dict(rtol=1e-9, atol=1e-11)  # fp32 compute
        assert all(r["sharded_at_loss"] == (variant in SHARDED) for r in res), variant
        assert all(r["resharded_after"] for r in res), variant  # nothing left unsharded after the step
        for rank, r in enumerate(res):
            torch.testing.assert_close(r["rollout_logp"].double(), o["logp"][rank * per:(rank + 1) * per], **tol)
        # Each rank's dapo loss is its masked sum over (all ranks' tokens / world): the ranks' losses
        # average to the whole-batch loss, and FSDP2 averages gradients over the ranks (reduce-scatter
        # with divide factor = world), so the reduced gradient is the whole-batch loss's, unscaled.
        torch.testing.assert_close(sum(r["loss"].double() for r in res) / WORLD, o["loss"], **tol)
        for r in res:  # every metric is reduced over the ranks: TRL's on the whole batch
            assert r["metrics"].keys() == o["metrics"].keys(), variant
            for k, v in o["metrics"].items():
                assert r["metrics"][k] == pytest.approx(v, rel=tol["rtol"], abs=tol["atol"]), (variant, k)
        assert set(res[0]["grads"]) == set(o["grads"]), variant
        for name, g in o["grads"].items():
            for r in res:
                assert r["grads"][name] is not None, (variant, name)
                torch.testing.assert_close(r["grads"][name], g, **tol, msg=lambda m, v=variant, n=name: f"{v} {n}: {m}")
