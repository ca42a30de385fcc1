"""The refcache subcommand: build, merge, info, verify."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from ..argtypes import non_negative_int, positive_float, positive_int, usage_error
from .errors import RefCacheError

_DTYPES = ("float32", "bfloat16", "float16", "float64")
PROG = "logitless refcache"
DESCRIPTION = ("A reference model's per-token log-probs over a fixed dataset, computed once and stored on disk, "
               "so that GRPO training with beta > 0 needs no reference model in memory (docs/refcache.md).")
DATA_HELP = """\
--data records (a .json list or {"data": [...]}, a .jsonl file with one record
per line, or a .parquet table), each one of:
  [5, 17, 9, ...]                  token ids; every position after the first is scored
  {"input_ids": [...], "loss_mask": [...]}
                                   the mask (0/1, same length; also "completion_mask"
                                   or "assistant_masks") selects the scored positions;
                                   an optional "attention_mask" drops padding first
  {"prompt_ids": [...], "completion_ids": [...]}
                                   TRL's layout, optional "prompt_mask" and
                                   "completion_mask"; the completion positions are scored
Every id must be below the model's vocabulary size.

Examples:
  logitless refcache build --model ./my-sft-model --data train.jsonl --out ref-cache \\
      --dtype bfloat16 --device cuda --batch-size 16 --temperature 0.9
  # two GPUs: one process per rank, then merge
  logitless refcache build ... --device cuda:0 --rank 0 --world-size 2
  logitless refcache build ... --device cuda:1 --rank 1 --world-size 2
  logitless refcache merge ref-cache"""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_KEY_HELP = ("file holding a secret key (at least 16 bytes) for the cache's HMAC, for caches shared between users "
             "(default: $LOGITLESS_REFCACHE_KEY if set, else no MAC); see docs/refcache.md, Trust and integrity")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the refcache sub-subcommands to ``parser``; alone, the subcommand prints its help."""
    parser.description = DESCRIPTION
    sub = parser.add_subparsers(dest="refcache_command", metavar="{build,merge,info,verify}")

    b = sub.add_parser("build", help="compute reference log-probs of a dataset with a local model",
                       description="Compute the reference log-probs of every record of --data with --model and "
                                   "store them in --out. Rerun the same command to resume an interrupted build.",
                       epilog=DATA_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--model", required=True,
                   help="the reference model: a local Hugging Face model directory, or a hub id (downloaded or "
                        "taken from the Hugging Face cache by transformers)")
    b.add_argument("--data", required=True, type=Path,
                   help="a .json, .jsonl or .parquet file of token-id records (see below)")
    b.add_argument("--out", required=True, type=Path, help="cache directory (created; rerun to resume)")
    b.add_argument("--tokenizer",
                   help="tokenizer directory or hub id, fingerprinted in the manifest (default: --model's; none "
                        "is recorded when --model has none)")
    b.add_argument("--dtype", choices=_DTYPES, default="float32", help="model dtype (default float32)")
    b.add_argument("--device", default="cpu", help="torch device, e.g. cuda or cuda:1 (default cpu)")
    b.add_argument("--batch-size", type=positive_int, default=8,
                   help="sequences per forward pass (default 8); the stored values do not depend on it")
    b.add_argument("--temperature", type=positive_float, default=1.0,
                   help="logits are divided by it before the log-softmax: use the GRPOConfig.temperature you "
                        "train with (default 1.0); RefCache.open refuses another")
    b.add_argument("--entropy", action="store_true", help="also store per-token entropies (nats)")
    b.add_argument("--part-bytes", type=positive_int, default=64 << 20,
                   help="value bytes per part file (default 67108864 = 64 MiB): a killed build resumes from the "
                        "last complete part")
    b.add_argument("--rank", type=non_negative_int, default=0,
                   help="this process's shard of a data-parallel build, 0 .. world-size - 1 (default 0)")
    b.add_argument("--world-size", type=positive_int, default=1,
                   help="processes building this cache together, each with its own --rank and the same --data; "
                        "run 'logitless refcache merge OUT' once all are done (default 1: no merge needed)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    b.add_argument("--key-file", type=Path, help=_KEY_HELP)
    b.set_defaults(func=_build)

    m = sub.add_parser("merge", help="index the parts of a sharded build once every rank finished",
                       description="Index the part files of a build run with --world-size > 1, once every rank "
                                   "has finished; the cache is then ready.")
    m.add_argument("path", type=Path, help="the cache directory")
    m.add_argument("--key-file", type=Path, help=_KEY_HELP)
    m.set_defaults(func=_merge)

    i = sub.add_parser("info", help="print a cache's manifest", description="Print a cache's manifest.")
    i.add_argument("path", type=Path, help="the cache directory")
    i.add_argument("--json", action="store_true", help="full manifest as JSON")
    i.set_defaults(func=_info)

    v = sub.add_parser("verify", help="rehash every file of a cache against its manifest",
                       description="Rehash every file of a cache against its manifest; exit status 1 and the bad "
                                   "file on corruption.")
    v.add_argument("path", type=Path, help="the cache directory")
    v.add_argument("--key-file", type=Path, help="file holding the key the cache was built with: its MAC is checked "
                                                 "too (default: $LOGITLESS_REFCACHE_KEY if set)")
    v.set_defaults(func=_verify)
    parser.set_defaults(func=lambda _args: parser.print_help() or 0)


def _existing_dir(path: Path, what: str) -> None:
    if not path.exists():
        usage_error(PROG, f"{what} {path}: no such directory")
    if not path.is_dir():
        usage_error(PROG, f"{what} {path}: not a directory")


def _model_source(text: str, what: str) -> str:
    """A local directory, or a hub id; a missing local path is reported as one."""
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            usage_error(PROG, f"{what} {text}: a file; pass the model's directory (with config.json)")
        return str(path)
    if not _HUB_ID.match(text) or text.startswith((".", "~")):
        usage_error(PROG, f"{what} {text}: no such directory")
    return text


def _device(text: str):
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        usage_error(PROG, f"--device {text!r} is not a torch device (e.g. cpu, cuda, cuda:1)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            usage_error(PROG, f"--device {text}, but no CUDA GPU is visible to PyTorch; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            usage_error(PROG, f"--device {text}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def _build(args: argparse.Namespace) -> int:
    try:
        return _build_checked(args)
    except KeyboardInterrupt:
        # Every file is renamed into place whole and the lock dies with the process: rerunning resumes.
        print(f"{PROG} build: interrupted; the parts written so far are kept, rerun the same command to resume",
              file=sys.stderr)
        return 130


def _build_checked(args: argparse.Namespace) -> int:
    # Everything checkable is checked before the model loads.
    if args.rank >= args.world_size:
        usage_error(PROG, f"--rank {args.rank} must be below --world-size {args.world_size}")
    if not args.data.is_file():
        usage_error(PROG, f"--data {args.data}: no such file")
    if args.out.exists() and not args.out.is_dir():
        usage_error(PROG, f"--out {args.out}: exists and is not a directory")
    if args.key_file is not None and not args.key_file.is_file():
        usage_error(PROG, f"--key-file {args.key_file}: no such file")
    model_src = _model_source(args.model, "--model")
    tok_src = None if args.tokenizer is None else _model_source(args.tokenizer, "--tokenizer")
    device = _device(args.device)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .build import BuildOptions, build
    from .dataset import load_records
    from .errors import RefCacheError

    try:
        records = load_records(args.data)
    except (ValueError, OSError) as e:  # json.JSONDecodeError is a ValueError
        usage_error(PROG, f"--data {args.data}: {str(e).splitlines()[0]}")
    try:
        model = AutoModelForCausalLM.from_pretrained(model_src, dtype=getattr(torch, args.dtype)).to(device)
    except (OSError, ValueError) as e:
        usage_error(PROG, f"--model {args.model}: no such local directory, and transformers cannot load it as a "
                          f"hub id: {str(e).splitlines()[0]}")
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_src or model_src)
    except (OSError, ValueError) as e:
        if tok_src:
            usage_error(PROG, f"--tokenizer {args.tokenizer}: cannot load it: {str(e).splitlines()[0]}")
        tokenizer = None
        print("note: no tokenizer found; the manifest records none", file=sys.stderr)
    options = BuildOptions(batch_size=args.batch_size, temperature=args.temperature, entropy=args.entropy,
                           part_bytes=args.part_bytes, progress=not args.no_progress, key_file=args.key_file)
    try:
        res = build(model, records, args.out, tokenizer=tokenizer, options=options, rank=args.rank,
                    world_size=args.world_size)
    except (RefCacheError, ValueError, TypeError) as e:
        print(f"{PROG} build: error: {e}", file=sys.stderr)
        return 1
    rate = res.sequences / res.seconds if res.seconds else float("nan")
    resumed = f"; resumed at batch {res.resumed_at}/{res.batches}" if res.resumed_at else ""
    print(f"rank {res.rank}/{res.world_size}: {res.sequences} sequences, {res.tokens} tokens in "
          f"{res.seconds:.1f} s ({rate:.1f} seq/s){resumed}")
    if res.manifest is not None:
        print(f"cache ready: {args.out} ({res.manifest.num_sequences} sequences)")
    elif args.world_size > 1:
        print(f"when every rank is done: logitless refcache merge {args.out}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from .build import merge
    from .errors import RefCacheError

    _existing_dir(args.path, "path")
    try:
        m = merge(args.path, key_file=args.key_file)
    except (RefCacheError, ValueError) as e:
        print(f"{PROG} merge: error: {e}", file=sys.stderr)
        return 1
    print(f"cache ready: {args.path} ({m.num_sequences} sequences, {m.num_tokens} tokens)")
    return 0


def _info(args: argparse.Namespace) -> int:
    from .errors import RefCacheError
    from .mac import MAC_FILE
    from .store import Store, manifest_summary

    _existing_dir(args.path, "path")
    try:
        d = manifest_summary(Store(args.path, check_mac=False).manifest)
    except RefCacheError as e:
        print(f"{PROG} info: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=True))
        return 0
    fp = d["fingerprint"]
    print(f"cache          {args.path}")
    print(f"sequences      {d['num_sequences']}  tokens {d['num_tokens']}  ({d['total_bytes'] / 2**20:.1f} MiB)")
    print(f"values         {d['value_dtype']}  entropy={d['has_entropy']}")
    print(f"model          {fp['model_class']}  V={fp['vocab_size']} H={fp['hidden_size']} dtype={fp['dtype']}")
    print(f"weights        {fp['model_weights']} ({fp['weights_hash_mode']})")
    print(f"tokenizer      {fp['tokenizer']}")
    print(f"transform      temperature={fp['temperature']} logit_scale={fp['logit_scale']} softcap={fp['softcap']}")
    print(f"built          {d['created_at']} by logitless {fp['library_version']}, {len(d['parts'])} part(s)")
    keyed = os.path.lexists(args.path / MAC_FILE)
    print("mac            " + (f"HMAC-SHA256 ({MAC_FILE}; not checked here: verify --key-file checks it)" if keyed
                               else "none (built without a key)"))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .mac import load_key
    from .store import Store

    _existing_dir(args.path, "path")
    try:
        Store(args.path, full_verify=True, key=load_key(args.key_file))
    except (RefCacheError, ValueError, TypeError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(f"OK: {args.path}")
    return 0
