"""Results on disk and for people: the run's JSON, ``BENCHMARKS.md`` (regenerated from every
JSON file in the results folder), the ratio-to-floor plot, and the console table."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("benchmarks") / "results"
PLOT_PATH = Path("benchmarks") / "bench.png"
MARKDOWN = "BENCHMARKS.md"

OBJECTIVE_TITLES = {
    "grpo": "GRPO (dapo, beta=0.04 KL to ref, clip + KL metrics, entropy), forward + backward",
    "ce": "SFT / cross-entropy (token mean), forward + backward",
    "rollout": "Rollout (no grad): target log-probs + entropy",
    "distill": "Distillation, forward KL(teacher‖student) token mean, forward + backward (floor: 4 GEMMs)",
    "jsd": "Distillation, generalized JSD (beta=0.5) token mean, forward + backward (floor: 4 GEMMs)",
    "dpo": ("DPO (sigmoid, beta=0.1, precomputed reference log-probs): sequence log-probs of chosen + rejected, "
            "forward + backward"),
    "kto": ("KTO (kto, beta=0.1, precomputed reference log-probs and KL estimate): sequence log-probs, "
            "forward + backward"),
    "simpo": "SimPO (beta=2, gamma=0.5, no reference): mean log-probs of chosen + rejected, forward + backward",
}
_DIFF_KEYS = ("loss_rel_diff", "logp_rel_diff", "entropy_rel_diff", "grad_hidden_rel_diff", "grad_weight_rel_diff")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "device"


def write_json(run: dict[str, Any], results_dir: Path) -> Path:
    """Write ``run`` to ``results_dir/<timestamp>-<device>.json``; returns the path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = run["timestamp"].replace(":", "").replace("-", "")
    kind = "e2e-" if run.get("kind") == "e2e" else ""
    path = results_dir / f"{stamp}-{kind}{_slug(run['device']['name'])}.json"
    tmp = path.with_suffix(".json.tmp")  # a crash leaves no half-written result behind
    tmp.write_text(json.dumps(run, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def load_runs(results_dir: Path, kind: str = "heads") -> list[dict[str, Any]]:
    """Every run JSON of ``kind`` (``"heads"``: the head benchmark; ``"e2e"``: whole GRPO
    steps) under ``results_dir``, oldest first (unreadable files are skipped)."""
    runs = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            run = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(run, dict) and ("models" in run if kind == "e2e" else "cases" in run):
            run["_file"] = path.name
            runs.append(run)
    runs.sort(key=lambda r: r.get("timestamp", ""))
    return runs


def _shape_label(case: dict[str, Any]) -> str:
    n = case["n_tokens"]
    short = f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)
    return f"{case['model']} N={short}"


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def _cell_time(r: dict[str, Any]) -> str:
    if r["status"] == "ok":
        ratio = f" · **{r['ratio_to_floor']:.2f}×**" if "ratio_to_floor" in r else ""
        if "in_step_ratio" in r:
            ratio += f" (in a step {r['in_step_ratio']:.2f}×)"
        t = r["time_ms"]
        ms = f"{t:.0f}" if t >= 100 else f"{t:.3g}"
        return f"{ms} ms{ratio} · {r['tflops']:.3g} TF/s"
    return r["status"]


def _cell_mem(r: dict[str, Any]) -> str:
    if r["status"] == "ok":
        return _gib(r["extra_bytes"]) if "extra_bytes" in r else "n/a"
    return r["status"]


def _row_order(run: dict[str, Any], objective: str) -> list[str]:
    names: list[str] = []
    for case in run["cases"]:
        for r in case["results"]:
            if r["objective"] == objective and r["row"] not in names:
                names.append(r["row"])
    return names


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in rows]
    return out


def _run_section(run: dict[str, Any]) -> list[str]:
    dev = run["device"]
    versions = ", ".join(f"{k} {v}" for k, v in run.get("versions", {}).items() if v)
    lines = [f"## {dev['name']} — {run['timestamp']}", "",
             f"`{run.get('command', 'logitless bench')}` · {versions} · file `{run.get('_file', '')}`", ""]
    cases = run["cases"]
    ent = ", ".join(f"{_shape_label(c)}: {c.get('mean_entropy', c.get('true_mean_entropy', float('nan'))):.2f}"
                    for c in cases)
    lines += [f"Mean entropy of the inputs (nats, measured by logitless): {ent}.", ""]
    labels = [_shape_label(c) for c in cases]
    for objective in run.get("objectives", OBJECTIVE_TITLES):
        names = _row_order(run, objective)
        if not names:
            continue
        by = {(c_i, r["row"]): r for c_i, c in enumerate(cases) for r in c["results"] if r["objective"] == objective}
        in_step = ("; in a step: each call queued behind 10 ms of GEMMs, as a training step calls its "
                   "head (only host work after a read of the device idles the GPU), over the floor timed so"
                   if any("in_step_ratio" in r for r in by.values()) else "")
        lines += [f"### {OBJECTIVE_TITLES.get(objective, objective)}", "",
                  "Median time from a synchronization · time / floor · TFLOP/s counted as "
                  f"{ {'rollout': '2NHV', 'distill': '8NHV', 'jsd': '8NHV'}.get(objective, '6NHV') }{in_step}:", ""]
        lines += _table(["row", *labels], [[n, *(_cell_time(by[(i, n)]) if (i, n) in by else "" for i in
                                                  range(len(cases)))] for n in names])
        if any("extra_bytes" in r for r in by.values()):
            lines += ["", "Peak extra memory, GiB (beyond inputs and the gradients / outputs every row returns):",
                      ""]
            lines += _table(["row", *labels], [[n, *(_cell_mem(by[(i, n)]) if (i, n) in by else "" for i in
                                                     range(len(cases)))] for n in names])
        notes = sorted({f"{r['row']}: {r['status']} ({r['reason']})" for r in by.values()
                        if r["status"] != "ok" and r.get("reason")})
        if notes:
            lines += [""] + [f"- {n}" for n in notes]
        lines.append("")
    agree = []
    for objective in run.get("objectives", OBJECTIVE_TITLES):
        for name in _row_order(run, objective):
            recs = [r for c in cases for r in c["results"] if r["objective"] == objective and r["row"] == name
                    and r["status"] == "ok" and r.get("agrees") is not None]
            if not recs:
                continue
            cells = []
            for key in _DIFF_KEYS:
                vals = [r[key] for r in recs if key in r]
                cells.append(f"{max(vals):.1e}" if vals else "")
            cells.append("yes" if all(r["agrees"] for r in recs) else "**no**")
            agree.append([objective, name, *cells])
    if agree:
        lines += ["### Same numbers? Max relative difference to logitless over the shapes", "",
                  "Scalars: `|x - ref| / |ref|`; tensors: `‖x - ref‖ / ‖ref‖`. Agrees: loss / log-probs within "
                  f"{run.get('tolerances', {}).get('loss', 1e-2):g}, gradients within "
                  f"{run.get('tolerances', {}).get('grad', 5e-2):g}.", ""]
        lines += _table(["objective", "row", "loss", "logp", "entropy", "grad hidden", "grad weight", "agrees"],
                        agree)
        lines.append("")
    return lines



E2E_CAPTION = (
    "One GRPO training step of the architecture with random weights (nothing downloaded): the policy's forward "
    "over prompt + completion, the loss, the backward and the optimizer step, on a batch already generated "
    "(generation, rewards and rollout log-probs excluded). **trl** is `trl.GRPOTrainer.compute_loss` (TRL 1.16 "
    "takes its log-probs from the model's forward with transformers' `fused_lm_head=True`), **logitless** "
    "is `LogitlessGRPOTrainer`, **trl-logits** is `trl.GRPOTrainer` with the log-prob path of TRL 1.15 "
    "(materialized `[B, T, V]` logits, `selective_log_softmax`); same model, same batch, TRL's default "
    "`GRPOConfig` (`loss_type=\"dapo\"`, `beta=0`, "
    "gradient checkpointing on). Completions have random lengths in [C/2, C] (the first one C). The optimizer is "
    "plain SGD without momentum for every model: it keeps no state, so a 7-8B model's bf16 weights and gradients "
    "fit in 80 GB (AdamW's two fp32 moments would add 8 bytes per parameter, 61 GB at 7.6B), and the memory "
    "difference between the paths is the loss path's alone. Time: median of the timed steps after one warm-up; "
    "peak: `torch.cuda.max_memory_allocated` during a step, weights included. *Largest micro-batch*: batch 1, "
    "the completion doubled until the step runs out of GPU memory (`≥`: the search stopped at its token cap).")


def _e2e_cell(s: dict[str, Any] | None) -> tuple[str, str]:
    if s is None:
        return "", ""
    if s["status"] != "ok":
        return s["status"], s["status"]
    t = s.get("time_ms")
    return (f"{t:.0f} ms" if t is not None else "n/a"), (_gib(s["peak_bytes"]) if "peak_bytes" in s else "n/a")


def _paths(items) -> list[str]:
    """The paths present, logitless first (the one the others are compared with)."""
    found = list(dict.fromkeys(items))
    return sorted(found, key=lambda p: p != "logitless")


def _max_fit_line(fit: dict[str, dict[str, Any]]) -> str:
    parts = []
    for path in _paths(fit):
        f = fit[path]
        n = f.get("max_fit_tokens")
        mark = "≥ " if f.get("capped") else ""
        if n is None:
            parts.append(f"{path} none (the smallest probe did not fit)")
        else:
            parts.append(f"{path} {mark}{n:,} tokens (completion {f['max_fit_completion_length']:,})"
                         + (" (search stopped by the time budget)" if f.get("stopped") else ""))
    line = "Largest micro-batch that fits (batch 1): " + ", ".join(parts)
    ours = fit.get("logitless", {}).get("max_fit_tokens")
    ratios = [f"{ours / n:.2g}× {path}'s" for path in _paths(fit)[1:]
              if ours and (n := fit[path].get("max_fit_tokens"))]
    if ratios:
        line += "; logitless fits " + ", ".join(ratios) + " tokens"
    return line + "."


def _skip_lines(m: dict[str, Any]) -> list[str]:
    """The logitless-skip rows of one model: step time and peak against the trl and logitless
    steps of the same batch (which run every completion), and the parity with TRL's step."""
    by = {(s["batch_size"], s["completion_length"], s["path"]): s for s in m["steps"]}
    rows = []
    for s in m["skip_steps"]:
        b, c = s["batch_size"], s["completion_length"]
        trl, ours = by.get((b, c, "trl"), {}), by.get((b, c, "logitless"), {})
        t = s.get("time_ms")
        rows.append([f"{b} × {c:,}", f"{s['zero_advantage_fraction']:.0%} ({s['zero_rows']} of {b})",
                     _e2e_cell(s)[0], *(f"{r['time_ms'] / t:.2f}×" if t and r.get("time_ms") else "—"
                                        for r in (trl, ours)),
                     _e2e_cell(s)[1], _e2e_cell(trl or None)[1]])
    lines = ["With `LogitlessConfig(skip_zero_advantage=True)` (completions with advantage 0, e.g. reward-constant "
             "groups, removed from the forward and backward; the same batch otherwise):", ""]
    lines += _table(["batch × completion", "advantages 0", "skip step", "trl / skip time", "logitless / skip time",
                     "skip peak GiB", "trl peak GiB"], rows)
    for p in m.get("skip_parity", []):
        if "grad_rel_diff" in p:
            lines += ["", f"Skip step against TRL's step, same weights and batch ({p['batch_size']} × "
                          f"{p['completion_length']:,}, {p['zero_advantage_fraction']:.0%} of advantages 0, old "
                          f"log-probs 0.1 nats off): loss |Δ| {p['loss_abs_diff']:.1e}; every parameter's "
                          f"gradient: relative difference {p['grad_rel_diff']:.1e}, largest absolute "
                          f"{p['grad_max_abs_diff']:.1e}."]
    return [*lines, ""]


def _e2e_section(run: dict[str, Any]) -> list[str]:
    dev = run["device"]
    versions = ", ".join(f"{k} {v}" for k, v in run.get("versions", {}).items() if v)
    st = run.get("settings", {})
    lines = [f"## End-to-end GRPO step: {dev['name']} — {run['timestamp']}", "",
             f"`{run.get('command', 'logitless bench --e2e')}` · {versions} · file `{run.get('_file', '')}`", "",
             E2E_CAPTION + f" Here: {st.get('dtype', '')} weights, prompt {st.get('prompt_length', '?')} tokens, "
             f"{st.get('optimizer', '')}.", ""]
    for m in run["models"]:
        lines += [f"### {m['model']} ({m['params'] / 1e9:.2f}B parameters, H={m['hidden_size']}, "
                  f"V={m['vocab_size']:,}, {m['layers']} layers)", ""]
        by = {(s["batch_size"], s["completion_length"], s["path"]): s for s in m["steps"]}
        paths = _paths(s["path"] for s in m["steps"])
        rows = []
        for b, c in dict.fromkeys((s["batch_size"], s["completion_length"]) for s in m["steps"]):
            cells = [_e2e_cell(by.get((b, c, path))) for path in paths]
            ours = by.get((b, c, "logitless"), {}).get("time_ms")
            speed = []
            for path in paths[1:]:
                t = by.get((b, c, path), {}).get("time_ms")
                speed.append(f"{t / ours:.2f}×" if t and ours else "—")
            rows.append([f"{b} × {c:,}", f"{b * (m['prompt_length'] + c):,}", *(t for t, _ in cells), *speed,
                         *(g for _, g in cells)])
        lines += _table(["batch × completion", "tokens", *(f"{p} step" for p in paths),
                         *(f"{p} / logitless time" for p in paths[1:]), *(f"{p} peak GiB" for p in paths)], rows)
        lines.append("")
        if m.get("max_fit"):
            lines += [_max_fit_line(m["max_fit"]), ""]
        p = m.get("parity", {})
        if "loss_abs_diff" in p:
            lines += [f"Same step, same weights and batch ({p['batch_size']} × {p['completion_length']:,}, old "
                      f"log-probs 0.1 nats off): loss trl {p['trl_loss']:.6g}, logitless {p['logitless_loss']:.6g} "
                      f"(|Δ| {p['loss_abs_diff']:.1e}); gradient norm relative difference "
                      f"{p['grad_norm_rel_diff']:.1e}; head gradient relative difference "
                      f"{p['head_grad_rel_diff']:.1e}.",
                      ""]
        if m.get("skip_steps"):
            lines += _skip_lines(m)
        notes = sorted({f"{s['path']} {s['batch_size']} × {s['completion_length']}: {s['status']} ({s['reason']})"
                        for s in (*m["steps"], *m.get("skip_steps", ()))
                        if s["status"] not in ("ok", "oom") and s.get("reason")})
        lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    return lines


def e2e_console(run: dict[str, Any]) -> str:
    """Plain-text summary of one ``--e2e`` run."""
    out = [f"{run['device']['name']}  {run['timestamp']}  (one GRPO training step per path)"]
    for m in run["models"]:
        out.append(f"\n{m['model']}  {m['params'] / 1e9:.2f}B parameters")
        out.append(f"  {'batch x completion':>20s} {'path':19s} {'ms':>10s} {'peak GiB':>9s} {'saved MiB':>10s}")
        for s in (*m["steps"], *m.get("skip_steps", ())):
            bc = f"{s['batch_size']} x {s['completion_length']}"
            path = s["path"] + (f" {s['zero_advantage_fraction']:.0%}" if "zero_advantage_fraction" in s else "")
            if s["status"] != "ok":
                out.append(f"  {bc:>20s} {path:19s} {s['status']}")
                continue
            peak = _gib(s["peak_bytes"]) if "peak_bytes" in s else "n/a"
            out.append(f"  {bc:>20s} {path:19s} {s.get('time_ms', float('nan')):10.1f} {peak:>9s} "
                       f"{s['saved_bytes'] / 2**20:10.1f}")
        if m.get("max_fit"):
            out.append("  " + _max_fit_line(m["max_fit"]))
    return "\n".join(out)


def render_markdown(runs: list[dict[str, Any]], plot_rel: str | None,
                    e2e_runs: list[dict[str, Any]] | None = None) -> str:
    """``BENCHMARKS.md`` for the head benchmark's ``runs`` and the ``--e2e`` runs (each newest
    first; whole training steps first: they are what a user's run will see)."""
    e2e_runs = e2e_runs or []
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `logitless bench` from the {len(runs) + len(e2e_runs)} JSON file(s) in `benchmarks/results/`; "
        "do not edit by hand: add a result with `logitless bench --update-repo` (or `--e2e --update-repo`), or rerun "
        "`logitless bench --report-only --update-repo`.",
        "",
        "*End-to-end GRPO step* sections time a whole training step of a real architecture through TRL and through "
        "logitless (`logitless bench --e2e`); the others time the head alone, as follows.",
        "",
        "Each row computes the same objective from `hidden [N, H]` and the head `weight [V, H]` (bf16) on one GPU, "
        "in one run. **floor** is the three bf16 cuBLAS GEMMs of the head alone (logits, d hidden, d weight; one "
        "GEMM for rollouts): no implementation can beat it, so *time / floor* is the overhead of everything else. "
        "Time is the median of several calls after warm-up (CUDA events); memory is "
        "`torch.cuda.max_memory_allocated` during one call beyond what was allocated before it, minus the outputs. "
        "Inputs are trained-model-like (mean entropy ~2 nats, targets sampled from the head's softmax). "
        "`oom`: did not fit (or predicted not to); `skipped`: library not installed here.",
        "",
    ]
    if plot_rel:
        lines += [f"![time / floor vs N]({plot_rel})", ""]
    if not runs and not e2e_runs:
        lines += ["No results yet.", ""]
    for run in reversed(e2e_runs):
        lines += _e2e_section(run)
    for run in reversed(runs):
        lines += _run_section(run)
    return "\n".join(lines).rstrip() + "\n"


def _plot_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest GPU run (newest of any device if none), with the cases of every earlier run on
    the same device name merged in (a newer run's case replaces an older one's), so that runs
    over different token counts make one curve."""
    gpu = [r for r in runs if r["device"].get("type") == "cuda"]
    pool = gpu or runs
    if not pool:
        return None
    newest = pool[-1]
    same = [r for r in pool if r["device"].get("name") == newest["device"].get("name")]
    cases: dict[tuple[str, int], dict[str, Any]] = {}
    for r in same:
        for c in r["cases"]:
            cases[(c["model"], c["n_tokens"])] = c
    objectives = list(dict.fromkeys(o for r in same for o in r.get("objectives", OBJECTIVE_TITLES)))
    return {**newest, "cases": list(cases.values()), "objectives": objectives}


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Ratio to floor vs ``N``, one line per row, one panel per (objective, model), of the newest
    GPU's runs merged (see :func:`_plot_run`). Returns whether a plot was written."""
    run = _plot_run(runs)
    if run is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objectives = [o for o in run.get("objectives", OBJECTIVE_TITLES) if any(
        r["objective"] == o for c in run["cases"] for r in c["results"])]
    models = list(dict.fromkeys(c["model"] for c in run["cases"]))
    if not objectives or not models:
        return False
    names = list(dict.fromkeys(r["row"] for c in run["cases"] for r in c["results"] if r["row"] != "floor"))
    palette = plt.get_cmap("tab20")
    colors = {n: palette(k % 20) for k, n in enumerate(names)}
    fig, axes = plt.subplots(len(objectives), len(models), figsize=(3.6 * len(models) + 2.2, 3.0 * len(objectives)),
                             squeeze=False, sharex=True)
    for i, objective in enumerate(objectives):
        for j, model in enumerate(models):
            ax = axes[i][j]
            cases = sorted((c for c in run["cases"] if c["model"] == model), key=lambda c: c["n_tokens"])
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="floor")
            for name in _row_order(run, objective):
                if name == "floor":
                    continue
                pts = [(c["n_tokens"], r["ratio_to_floor"]) for c in cases for r in c["results"]
                       if r["objective"] == objective and r["row"] == name and "ratio_to_floor" in r]
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, marker="o", color=colors[name])
            ax.set_xscale("log", base=2)
            ratios = [line.get_ydata() for line in ax.get_lines()]
            if ratios and max(max(r) for r in ratios) > 8:
                ax.set_yscale("log", base=2)
            ax.set_title(f"{objective} · {model}", fontsize=9)
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel("time / floor")
            if i == len(objectives) - 1:
                ax.set_xlabel("N tokens")
            if j == len(models) - 1:  # one legend per objective, naming every row of any panel
                from matplotlib.lines import Line2D

                handles = [Line2D([], [], color="black", linestyle="--", linewidth=1, label="floor")]
                handles += [Line2D([], [], color=colors[n], marker="o", label=n)
                            for n in _row_order(run, objective) if n != "floor"]
                ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"{run['device']['name']} — {run['timestamp']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def regenerate(out_dir: Path, results_dir: Path | None = None) -> tuple[Path, Path | None]:
    """Rewrite ``out_dir/BENCHMARKS.md`` and ``out_dir/benchmarks/bench.png`` from every JSON in
    ``results_dir`` (default ``out_dir/benchmarks/results``). Returns both paths (plot ``None``
    when there was nothing to plot)."""
    results_dir = out_dir / RESULTS_DIR if results_dir is None else results_dir
    runs = load_runs(results_dir)
    png = out_dir / PLOT_PATH
    made = plot(runs, png)
    md = out_dir / MARKDOWN
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text(render_markdown(runs, PLOT_PATH.as_posix() if made else None, load_runs(results_dir, "e2e")))
    tmp.replace(md)
    return md, png if made else None


def console_table(run: dict[str, Any]) -> str:
    """Plain-text summary of one run: one block per case and objective (``--e2e`` runs: one
    block per model)."""
    if run.get("kind") == "e2e":
        return e2e_console(run)
    out = [f"{run['device']['name']}  {run['timestamp']}"]
    for case in run["cases"]:
        out.append(f"\n{_shape_label(case)}  H={case['hidden_size']} V={case['vocab_size']}  "
                   f"mean entropy {case.get('mean_entropy', case.get('true_mean_entropy', float('nan'))):.2f} nats")
        out.append(f"  {'objective':9s} {'row':26s} {'ms':>9s} {'x floor':>8s} {'TFLOP/s':>8s} {'extra GiB':>9s} "
                   f"{'max rel diff':>12s}")
        for r in case["results"]:
            if r["status"] != "ok":
                out.append(f"  {r['objective']:9s} {r['row']:26s} {r['status']}: {r['reason']}")
                continue
            diffs = [r[k] for k in _DIFF_KEYS if k in r]
            # The reference row is what the others are compared with; the floor computes no loss.
            diff = f"{max(diffs):.1e}" if diffs else {"reference": "(reference)"}.get(r.get("role"), "-")
            ratio = f"{r['ratio_to_floor']:.2f}" if "ratio_to_floor" in r else "-"
            out.append(f"  {r['objective']:9s} {r['row']:26s} {r['time_ms']:9.2f} {ratio:>8s} {r['tflops']:8.1f} "
                       f"{_gib(r['extra_bytes']) if 'extra_bytes' in r else 'n/a':>9s} {diff:>12s}")
    return "\n".join(out)
