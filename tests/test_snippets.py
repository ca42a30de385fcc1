"""Every ```python block of README.md and docs/*.md runs as written on a CPU.

A block that cannot (a GPU, several processes, a package the tests do not install) carries an
HTML comment on the line before its fence, with the reason::

    <!-- snippet: skip (needs a CUDA GPU) -->

New blocks and new pages under docs/ are picked up by themselves. The blocks run one after the
other in one fresh interpreter (imports are paid once), each in its own namespace and its own
empty working directory, with the model hub switched off and a time limit per block.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP = re.compile(r"^<!--\s*snippet:\s*skip\b(.*?)-->\s*$")
REASON = re.compile(r"^\s*\((.*\S.*)\)\s*$")
BLOCK_SECONDS = 60


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the marker's reason; "" for a marker without one

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    """The ```python blocks of every page, with the skip marker (if any) on the line before."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start, body = i, []
                i += 1
                while i < len(lines) and lines[i].strip() != "```":
                    body.append(lines[i])
                    i += 1
                prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
                marker = SKIP.match(prev.strip())
                skip = None
                if marker:
                    reason = REASON.match(marker.group(1))
                    skip = reason.group(1).strip() if reason else ""
                code = textwrap.dedent("\n".join(body)) + "\n"  # a block inside a list item is indented
                found.append(Block(str(page.relative_to(REPO)), start + 1, code, skip))
            i += 1
    return found


BLOCKS = blocks()

# Runs in the child: each block compiled under its page:line name (tracebacks point at the
# page), executed in a fresh namespace and a fresh working directory; its output is kept.
_RUNNER = r"""
import contextlib, io, json, os, signal, sys, tempfile, time, traceback, warnings
warnings.simplefilter("ignore")
blocks, limit, out, work = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3], sys.argv[4]
def expire(*_):
    raise TimeoutError(f"the block ran for more than {limit} s")
signal.signal(signal.SIGALRM, expire)
results = {}
for b in blocks:
    cwd = tempfile.mkdtemp(prefix="snippet-", dir=work)
    os.chdir(cwd)
    buf, t, c = io.StringIO(), time.perf_counter(), time.process_time()
    signal.alarm(limit)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            exec(compile(b["code"], b["id"], "exec"), {"__name__": "__main__"})
        error = None
    except BaseException:
        error = traceback.format_exc(limit=-8)
    finally:
        signal.alarm(0)
    results[b["id"]] = {"error": error, "output": buf.getvalue()[-3000:], "seconds": time.perf_counter() - t,
                    "cpu_seconds": time.process_time() - c}
    with open(out, "w") as f:  # after every block: a crash of the interpreter still leaves the others
        json.dump(results, f)
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("snippets")
    todo = [{"id": b.id, "code": b.code} for b in BLOCKS if b.skip is None]
    (tmp / "blocks.json").write_text(json.dumps(todo))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    out = tmp / "results.json"
    r = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(tmp / "blocks.json"), str(BLOCK_SECONDS), str(out), str(tmp)],
        capture_output=True,
        text=True,
        env=env,
        timeout=BLOCK_SECONDS * (len(todo) + 1),
        check=False,
    )
    got = json.loads(out.read_text()) if out.exists() else {}
    if r.returncode != 0:
        # The interpreter died inside a block (a crash, not an exception): blame that block.
        last = next((b["id"] for b in todo if b["id"] not in got), None)
        if last is not None:
            got[last] = {"error": f"the interpreter exited with {r.returncode}:\n{r.stderr[-3000:]}", "output": ""}
    return got


def test_pages_have_python_blocks():
    assert len(BLOCKS) >= 10 and {b.page for b in BLOCKS} >= {"README.md"}


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip is not None], ids=lambda b: b.id)
def test_every_skip_says_why(block):
    assert len(block.skip.split()) >= 2, f"{block.id}: give the reason, e.g. <!-- snippet: skip (needs a CUDA GPU) -->"


def test_every_skip_marker_precedes_a_python_block():
    starts = {(b.page, b.line) for b in BLOCKS}
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if SKIP.match(line.strip()):
                nxt = next((j for j in range(i + 1, len(lines)) if lines[j].strip()), None)
                rel = str(page.relative_to(REPO))
                assert nxt is not None and (rel, nxt + 1) in starts, f"{rel}:{i + 1}: no ```python block follows"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip is None], ids=lambda b: b.id)
def test_snippet_runs_as_written(block, results):
    assert block.id in results, f"{block.id} did not run (an earlier block crashed the interpreter)"
    r = results[block.id]
    assert r["error"] is None, f"{block.id} failed:\n{r['error']}\noutput:\n{r['output']}"
