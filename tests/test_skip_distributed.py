"""``skip_zero_advantage`` under DistributedDataParallel and FSDP2, 2 gloo ranks on CPU: a rank
whose micro-batch has no row with gradient still runs one row (loss times 0) and joins the
gradient all-reduce / reduce-scatter and the metric collectives; the averaged gradients equal the
mean of each rank's loss on its whole micro-batch (no row removed), and the restored clip-ratio
metrics equal those of both ranks' rows together, to 1e-10. The trainer is a stand-in holding what
the switch reads of ``LogitlessGRPOTrainer`` (its options and metrics), so the ranks import neither
TRL nor transformers; the per-row semantics against TRL itself are in ``tests/test_trl_skip.py``,
the drop-in's FSDP2 head (``head_inputs``) in ``tests/test_fsdp.py``."""

from __future__ import annotations

import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import this module by name
from gloo_ranks import run_ranks

if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

WORLD, B, P, T, H, V = 2, 4, 2, 5, 8, 29
CFG = dict(loss_type="grpo", epsilon=0.1, epsilon_high=0.15, gradient_accumulation_steps=2)
WRAPPERS = ("ddp", "fsdp2")
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max")


class Policy(torch.nn.Module):
    """A causal stand-in for a language model: hidden states from a running mean of embeddings
    (position t sees tokens ≤ t), and an untied head used outside ``forward``, as the drop-in
    uses ``lm_head``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, H, dtype=torch.float64)
        self.mix = torch.nn.Linear(H, H, dtype=torch.float64)
        self.head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)

    def forward(self, ids):
        e = self.embed(ids)
        mean = e.cumsum(1) / torch.arange(1, ids.shape[1] + 1, dtype=e.dtype)[:, None]
        return torch.tanh(self.mix(mean))


def _batches():
    """Two iterations × two ranks of micro-batches; in each iteration one rank has no advantage."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for it in range(2):
        per_rank = []
        for rank in range(WORLD):
            lengths = torch.randint(1, T + 1, (B,), generator=gen)
            mask = (torch.arange(T)[None] < lengths[:, None]).long()
            adv = torch.randn(B, generator=gen, dtype=torch.float64)
            adv[[1, 2] if rank != it else list(range(B))] = 0.0
            per_rank.append(dict(
                prompt_ids=torch.randint(0, V, (B, P), generator=gen), prompt_mask=torch.ones(B, P, dtype=torch.long),
                completion_ids=torch.randint(0, V, (B, T), generator=gen), completion_mask=mask, advantages=adv,
                old_shift=0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)))
        out.append(per_rank)
    return out


def _loss(model, head, inputs, world, group):
    from logitless import PassOptions, PolicyConfig, policy_loss

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    t = inputs["completion_ids"].shape[1]
    hidden = model(ids)[:, P - 1:P - 1 + t]
    return policy_loss(hidden, head.weight, inputs["completion_ids"], inputs["completion_mask"],
                       inputs["advantages"], inputs["old_per_token_logps"],
                       config=PolicyConfig(**CFG, num_processes=world), group=group,
                       options=PassOptions(impl="torch"))


def _with_old_logps(model, inputs):
    from logitless import token_logprobs

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    with torch.no_grad():
        cur = token_logprobs(model(ids)[:, P - 1:-1], model.head.weight, inputs["completion_ids"])
    out = {k: v for k, v in inputs.items() if k != "old_shift"}
    return dict(out, old_per_token_logps=cur + inputs["old_shift"])


def _stand_in(world: int, loss_fn):
    """What ``loss_without_zero_advantage`` reads of a ``LogitlessGRPOTrainer``."""
    from logitless import PassOptions
    from logitless.integrations.config import LogitlessConfig, Switches

    sw = Switches(config=LogitlessConfig(skip_zero_advantage=True), fused_loss=True, fused_logprobs=True,
                  options=PassOptions(impl="torch"))
    tr = types.SimpleNamespace(logitless=sw, beta=0.0, entropy_coef=0.0, top_entropy_quantile=1.0,
                               loss_type=CFG["loss_type"], importance_sampling_level="token",
                               accelerator=types.SimpleNamespace(num_processes=world),
                               _metrics={"train": defaultdict(list)})

    def fused(model, sub):
        loss, metrics = loss_fn(model, sub)
        for k, v in metrics.items():
            tr._metrics["train"][k].append(v.item())
        tr.rows.append(sub["completion_ids"].shape[0])
        return loss

    tr.rows = []
    return tr, fused


def _wrap(model, how: str, world: int):
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # The root (head included) stays unsharded after forward, so the stand-in's loss can read the
    # head outside forward; the drop-in gathers it through FSDP with head_inputs instead.
    return fully_shard(model, mesh=init_device_mesh("cpu", (world,)), reshard_after_forward=False)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rank(rank: int, world: int, batches) -> dict:
    from logitless.integrations.trl_skip import loss_without_zero_advantage

    out = {}
    for how in WRAPPERS:
        # the head of the model the loss is given (DDP wraps it, fully_shard is the module itself)
        tr, fused = _stand_in(world, lambda m, sub: _loss(m, getattr(m, "module", m).head, sub, world,
                                                          dist.group.WORLD))
        steps = []
        for it in range(2):  # a fresh model per step (no optimizer here); the rollout on a plain copy
            inputs = _with_old_logps(Policy(), batches[it][rank])
            model = Policy()
            wrapped = _wrap(model, how, world)
            loss = loss_without_zero_advantage(tr, wrapped, inputs, fused)
            loss.backward()  # the gradient all-reduce / reduce-scatter: a rank left out would stall the other
            steps.append(dict(loss=loss.detach(), metrics={k: v[-1] for k, v in tr._metrics["train"].items()},
                              grads={n: _full(p.grad).clone() for n, p in model.named_parameters()}))
        out[how] = dict(steps=steps, rows=tr.rows)
    return out


def _spawn(batches) -> list[dict]:
    # A rank left out of a collective stalls the others: 120 s is well past a normal run.
    return run_ranks(_rank, WORLD, batches, timeout_s=120)


@pytest.fixture(scope="module")
def ranks():
    batches = _batches()
    return batches, _spawn(batches)


@pytest.mark.parametrize("how", WRAPPERS)
def test_ranks_join_with_an_empty_micro_batch(ranks, how):
    batches, outs = ranks
    outs = [o[how] for o in outs]
    # Iteration 0: rank 0 has no row with gradient (one row runs, times 0), rank 1 runs 2 rows; then swapped.
    assert outs[0]["rows"] == [1, 2] and outs[1]["rows"] == [2, 1]
    model = Policy()
    for it in range(2):
        grads, losses = [], []
        for rank in range(WORLD):  # each rank's whole micro-batch, nothing removed
            model.zero_grad(set_to_none=True)
            loss, _ = _loss(model, model.head, _with_old_logps(model, batches[it][rank]), WORLD, None)
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        both = {k: torch.cat([_with_old_logps(model, batches[it][r])[k] for r in range(WORLD)])
                for k in _with_old_logps(model, batches[it][0]) if k != "num_items_in_batch"}
        _, metrics = _loss(model, model.head, both, WORLD, None)  # metrics over both ranks' rows
        assert float(losses[it]) == 0.0
        for rank in range(WORLD):
            step = outs[rank]["steps"][it]
            assert abs(float(step["loss"] - losses[rank])) <= 1e-10 * max(1.0, abs(float(losses[rank])))
            for name, g in grads[0].items():  # DDP and FSDP2 average the ranks' gradients
                mean = (g + grads[1][name]) / WORLD
                assert float((step["grads"][name] - mean).abs().max()) <= 1e-10 * max(1.0, float(mean.abs().max()))
            for k in CLIP_METRICS:
                assert step["metrics"][k] == pytest.approx(float(metrics[k]), rel=1e-10, abs=1e-12, nan_ok=True), k
        assert any(float(metrics[k]) > 0 for k in CLIP_METRICS)  # the restoration is not checked on zeros
