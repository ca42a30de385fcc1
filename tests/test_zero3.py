"""DeepSpeed ZeRO-3 models through find_head / head_inputs, 2 gloo ranks on CPU with the real
DeepSpeed engine: a next-token loss computed by logitless from the hidden states and the
partitioned head gives every parameter the gradient (after DeepSpeed's own reduction and
partitioning) of a single-process oracle on both ranks' data with materialized logits, head
untied and tied to the embeddings; the no-grad log-probs match too, and the head is partitioned
again afterwards.

Skipped where ``deepspeed`` is not installed (it is not a test dependency: PyPI ships it as a
source distribution that builds against torch). Install it with
``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`` to run these; DeepSpeed then runs on
its CPU accelerator with gloo.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("deepspeed", reason="deepspeed is not installed (optional; see the module docstring)")

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import this module by name
from gloo_ranks import run_ranks

WORLD = 2
B, L, V = 2, 7, 96


def _tiny_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # an untrained head is near uniform; make the softmax matter
        model.get_output_embeddings().weight.normal_(0.0, 1.0)
    return model


def _batch(rank: int):
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, V, (B, L), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that does not count
    return ids, labels


def _nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V).double(), labels[:, 1:].reshape(-1))


def _rank(rank: int, world: int, tie: bool):
    os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU path on any machine (the group is gloo)
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    import logitless
    from logitless.model_heads import add_hidden_states_forward, find_head, head_inputs

    os.environ.setdefault("LOCAL_RANK", str(rank))
    model = _tiny_llama(tie)
    add_hidden_states_forward(model)
    config = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config, dist_init_required=False
    )
    head = find_head(engine.module)
    partitioned = head.zero3 and head.weight.numel() == 0
    ids, labels = _batch(rank)
    steps = []
    # Step 1 finds the head partitioned. From step 2 DeepSpeed's prefetcher (which traced step 1)
    # may hold it gathered when the loss runs: both paths of head_inputs run.
    for _ in range(2):
        hidden = engine(input_ids=ids, logitless_hidden_states=True)
        before = head.weight.ds_status.name
        h, ready = head_inputs(hidden[:, :-1], head)
        loss, _ = logitless.cross_entropy(h, ready, labels[:, 1:])
        engine.backward(loss)
        grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        after = (head.weight.ds_status.name, head.weight.numel())
        engine.step()  # lr 0: the weights stay, the gradients are cleared
        steps.append(dict(loss=float(loss), grads=grads, before=before, after=after))
    with torch.no_grad():
        hidden = engine(input_ids=ids, logitless_hidden_states=True)
        h, ready = head_inputs(hidden[:, :-1], head)
        logps = logitless.token_logprobs(h, ready, labels[:, 1:])
    return dict(steps=steps, logps=logps, partitioned=partitioned)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_zero3_head_gradient_is_reduced_once_by_deepspeed(tie):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    results = run_ranks(_rank, WORLD, tie)
    model = _tiny_llama(tie).double()
    losses, logps = [], []
    for rank in range(WORLD):
        ids, labels = _batch(rank)
        logits = model(input_ids=ids).logits
        losses.append(_nll(logits, labels))
        with torch.no_grad():
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
            logps.append(lp.masked_fill(labels[:, 1:] == -100, 0.0))
    # DeepSpeed averages the ranks' gradients: the oracle is the gradient of the mean of their losses.
    torch.stack(losses).mean().backward()
    for rank, r in enumerate(results):
        assert r["partitioned"] and r["steps"][0]["before"] == "NOT_AVAILABLE"
        torch.testing.assert_close(
            r["logps"].double().masked_fill(_batch(rank)[1][:, 1:] == -100, 0.0), logps[rank], rtol=1e-5, atol=1e-5
        )
        for step in r["steps"]:
            assert step["after"] == ("NOT_AVAILABLE", 0)  # partitioned again once its gradient is reduced
            assert step["loss"] == pytest.approx(float(losses[rank]), rel=1e-5)
            for name, p in model.named_parameters():
                g = step["grads"][name].double()
                torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
