"""The ``logitless`` command line as a new user meets it: every usage error of ``bench`` and
``refcache`` exits with status 2 and one ``error:`` line (never a traceback) before any work
runs; help texts are plain text; ``--version``; subcommands alone print their help."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import logitless
from logitless.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()

BENCH_ERRORS = [
    ["--quick", "--tokens", "abc"],
    ["--tokens", "0"],
    ["--tokens", "8k,-1"],
    ["--entropy", "-1"],
    ["--entropy", "nan"],
    ["--min-time", "-1"],
    ["--reps", "0"],
    ["--time-budget", "0"],
    ["--seed", "-3"],
    ["--objectives", "grpo,bogus"],
    ["--rows", "nope"],
    ["--objectives", "grpo,distill", "--rows", "logitless-fused"],  # distill's row is "logitless"
    ["--impl", "cuda"],
    ["--shapes", "8k"],
    ["--shapes", "8k:nope"],
    ["--shapes", "102:tiny-a"],
    ["--models", "gpt5"],
    ["--models", "tiny-a", "--tokens", "102"],
    ["--quick", "--full"],
    ["--dtype", "int8"],
    ["--device", "tpu"],
    ["--bogus-flag"],
    ["--e2e", "--shapes", "128:tiny-a"],
    ["--e2e", "--objectives", "grpo"],
    ["--completion-lengths", "64"],
    ["--e2e", "--batch-sizes", "0"],
    ["--e2e", "--completion-lengths", "16,x"],
    ["--e2e", "--models", "tiny-a"],
    ["--e2e", "--max-tokens", "-1"],
    ["--e2e", "--prompt-length", "0"],
    ["--e2e", "--zero-advantage-fractions", "0.25,1.5"],
    ["--zero-advantage-fractions", "0.5"],
    ["--out", "x", "--update-repo"],
    ["--out", str(REPO)],
    ["--report-only", "--out", str(REPO)],
    ["--report-only"],
    ["--out", "a-file"],
    ["--results-dir", "a-file"],
]
if NO_GPU:
    BENCH_ERRORS.append(["--device", "cuda"])


def _expect_usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("logitless") and ": error: " in lines[-1], err
    assert sum(": error: " in ln for ln in lines) == 1, err
    return lines[-1]


@pytest.mark.parametrize("argv", BENCH_ERRORS, ids=" ".join)
def test_bench_usage_errors_exit_2_with_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    _expect_usage_error(["bench", *argv], capsys)
    assert not (tmp_path / "bench_out").exists()  # refused before anything was written


@pytest.fixture
def build_env(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps([3, 5, 7, i]) for i in range(4)) + "\n")
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "a-file").write_text("x")
    return tmp_path, data, model


def _build_cases(tmp: Path, data: Path, model: Path) -> list[list[str]]:
    base = ["refcache", "build", "--model", str(model), "--data", str(data), "--out", str(tmp / "cache")]
    bad_ext = tmp / "data.txt"
    bad_ext.write_text("[1, 2]")
    cases = [
        ["refcache", "bogus"],
        ["refcache", "build"],
        ["refcache", "build", "--model", str(model), "--data", str(data)],
        ["refcache", "build", "--model", str(model), "--data", str(tmp / "missing.jsonl"), "--out", str(tmp / "c")],
        ["refcache", "build", "--model", str(tmp / "no-such-model"), "--data", str(data), "--out", str(tmp / "c")],
        ["refcache", "build", "--model", "./no-such-model", "--data", str(data), "--out", str(tmp / "c")],
        ["refcache", "build", "--model", str(tmp / "a-file"), "--data", str(data), "--out", str(tmp / "c")],
        [*base, "--tokenizer", str(tmp / "no-such-tokenizer")],
        [*base, "--batch-size", "0"],
        [*base, "--batch-size", "two"],
        [*base, "--temperature", "0"],
        [*base, "--temperature", "-1"],
        [*base, "--temperature", "inf"],
        [*base, "--part-bytes", "0"],
        [*base, "--rank", "-1"],
        [*base, "--world-size", "0"],
        [*base, "--rank", "2", "--world-size", "2"],
        [*base, "--dtype", "int8"],
        [*base, "--device", "bogus"],
        ["refcache", "build", "--model", str(model), "--data", str(data), "--out", str(tmp / "a-file")],
        ["refcache", "build", "--model", str(model), "--data", str(bad_ext), "--out", str(tmp / "c")],
        ["refcache", "info"],
        ["refcache", "info", str(tmp / "no-cache")],
        ["refcache", "info", str(tmp / "a-file")],
        ["refcache", "verify", str(tmp / "no-cache")],
        ["refcache", "merge", str(tmp / "no-cache")],
    ]
    if NO_GPU:
        cases.append([*base, "--device", "cuda"])
    return cases


N_BUILD_CASES = 27 if NO_GPU else 26


@pytest.mark.parametrize("case", range(N_BUILD_CASES))
def test_refcache_usage_errors_exit_2_with_one_line(case, build_env, capsys):
    tmp, data, model = build_env
    cases = _build_cases(tmp, data, model)
    assert len(cases) == N_BUILD_CASES
    line = _expect_usage_error(cases[case], capsys)
    assert not (tmp / "cache").exists() and not (tmp / "c").exists()
    if "no-such-model" in " ".join(cases[case]):
        assert "no such directory" in line  # a missing local path, not a bad hub id


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"logitless {logitless.__version__}"


def test_bare_command_prints_usage_and_exits_2(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("usage: logitless")
    assert all(name in captured.err for name in ("demo", "bench", "refcache", "env"))


def test_refcache_alone_prints_help(capsys):
    assert main(["refcache"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: logitless") and all(n in out for n in ("build", "merge", "info", "verify"))


def test_help_imports_no_torch():
    # torch (and its compiler stack, torch._dynamo) takes seconds to import: --help, a bare
    # `logitless` and `import logitless` must not pay for it. A fresh interpreter, so that
    # nothing this test session imported counts.
    code = ("import sys, contextlib, io\n"
            "import logitless\n"
            "assert 'torch' not in sys.modules, 'import logitless'\n"
            "from logitless.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    for argv in (['--help'], []):\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'trl')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_lazy_package_keeps_the_public_api():
    from logitless.objectives import policy_loss
    from logitless.ops import Head

    assert logitless.policy_loss is policy_loss and logitless.Head is Head
    assert set(logitless.__all__) <= set(dir(logitless))
    for name in logitless.__all__:
        assert getattr(logitless, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        logitless.no_such_name  # noqa: B018


def test_env_reports_versions_backend_and_trl(capsys):
    import trl

    from logitless.cli import env_report
    from logitless.ops.contract import resolve_backend

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    r = env_report()
    assert r["versions"]["torch"] == torch.__version__ and r["versions"]["trl"] == trl.__version__
    assert r["versions"]["logitless"] == logitless.__version__
    assert r["trl_tested"] == trl.__version__.startswith("1.16.")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    want = resolve_backend("auto", torch.empty(1, 1, dtype=torch.bfloat16, device=device)).NAME
    assert r["auto_backend"]["bfloat16"] == want
    assert f"bfloat16 -> {want}" in out and f"trl           {trl.__version__}" in out
    assert ("no CUDA device" in out) == (not torch.cuda.is_available())


def test_bench_help_says_what_a_cpu_run_means(capsys):
    out = " ".join(_help(["bench"], capsys).split())
    assert "CPU" in out and "not representative" in out


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["bench"], ["demo"], ["env"], ["refcache"], ["refcache", "build"],
                                  ["refcache", "merge"], ["refcache", "info"], ["refcache", "verify"]], ids=" ".join)
def test_help_is_plain_text(argv, capsys):
    out = _help(argv, capsys)
    assert "``" not in out and ":func:" not in out and ":class:" not in out


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def test_refcache_build_help_documents_every_option_and_the_records(capsys):
    build = _subparser(_subparser(build_parser(), "refcache"), "build")
    for action in build._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help.split()) >= 3, action.option_strings  # words, not a bare flag
    out = _help(["refcache", "build"], capsys)
    for option in ("--batch-size", "--temperature", "--part-bytes", "--rank", "--world-size", "--no-progress"):
        assert option in out
    for field in ("input_ids", "loss_mask", "completion_mask", "assistant_masks", "attention_mask", "prompt_ids",
                  "completion_ids", "prompt_mask", ".jsonl", ".parquet"):
        assert field in out, field


def test_fresh_build_then_info_and_verify(tmp_path, capsys):
    from tiny_models import save_tiny_qwen2

    model = save_tiny_qwen2(tmp_path / "m", vocab_size=64, seed=2)
    g = torch.Generator().manual_seed(5)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt_ids": torch.randint(0, 61, (3,), generator=g).tolist(),
                                          "completion_ids": torch.randint(0, 61, (4,), generator=g).tolist()})
                              for _ in range(5)) + "\n")
    out = tmp_path / "cache"
    assert main(["refcache", "build", "--model", str(model), "--data", str(data), "--out", str(out),
                 "--batch-size", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "5 sequences, 35 tokens" in printed  # 5 x (3 prompt + 4 completion) and f"cache ready: {out}" in printed
    assert "resumed" not in printed  # nothing was resumed
    assert main(["refcache", "info", str(out)]) == 0 and "sequences      5" in capsys.readouterr().out
    assert main(["refcache", "verify", str(out)]) == 0


def test_bench_rows_without_objectives_run_the_objectives_that_have_them(monkeypatch, tmp_path):
    """``--rows`` alone runs only the objectives with one of those rows (rollout and distillation
    have no ``logitless-fused`` row: they would time their floor alone); with ``--objectives`` an
    objective none of whose rows is asked for is a usage error (``BENCH_ERRORS``)."""
    from logitless.bench import cli as bench_cli

    class Ran(Exception):
        pass

    def stop(case, opts, log):
        raise Ran(opts.objectives)

    monkeypatch.setattr(bench_cli, "run_case", stop)
    with pytest.raises(Ran) as ran:
        main(["bench", "--device", "cpu", "--quick", "--rows", "logitless-fused", "--out", str(tmp_path)])
    asked = ran.value.args[0]
    assert "grpo" in asked and "dpo" in asked and "ce" in asked
    assert not {"rollout", "distill", "jsd"} & set(asked), asked
