"""``logitless refcache build | merge | info | verify``."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import RefCacheError

_DTYPES = ("float32", "bfloat16", "float16", "float64")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``refcache`` sub-subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="refcache_command", required=True)

    b = sub.add_parser("build", help="compute reference log-probs of a dataset with a local model")
    b.add_argument("--model", required=True, help="Hugging Face model directory (or hub id already cached)")
    b.add_argument("--data", required=True, help=".json / .jsonl / .parquet records of token ids")
    b.add_argument("--out", required=True, help="cache directory (rerun to resume)")
    b.add_argument("--tokenizer", help="tokenizer directory (default: --model; skipped if none loads)")
    b.add_argument("--dtype", choices=_DTYPES, default="float32", help="model dtype (default float32)")
    b.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0 (default cpu)")
    b.add_argument("--batch-size", type=int, default=8)
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--entropy", action="store_true", help="also store per-token entropies")
    b.add_argument("--part-bytes", type=int, default=64 << 20, help="value bytes per part file (resume granularity)")
    b.add_argument("--rank", type=int, default=0)
    b.add_argument("--world-size", type=int, default=1)
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_build)

    m = sub.add_parser("merge", help="index the parts of a sharded build once every rank finished")
    m.add_argument("path")
    m.set_defaults(func=_merge)

    i = sub.add_parser("info", help="print a cache's manifest")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="full manifest as JSON")
    i.set_defaults(func=_info)

    v = sub.add_parser("verify", help="rehash every file of a cache against its manifest")
    v.add_argument("path")
    v.set_defaults(func=_verify)
    parser.set_defaults(func=lambda _args: parser.print_help() or 2)


def _build(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .build import BuildOptions, build
    from .dataset import load_records

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device)
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except (OSError, ValueError):
        if args.tokenizer:
            raise
        tokenizer = None
        print("note: no tokenizer found; the manifest records none", file=sys.stderr)
    options = BuildOptions(batch_size=args.batch_size, temperature=args.temperature, entropy=args.entropy,
                           part_bytes=args.part_bytes, progress=not args.no_progress)
    try:
        res = build(model, load_records(args.data), args.out, tokenizer=tokenizer, options=options, rank=args.rank,
                    world_size=args.world_size)
    except RefCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rate = res.sequences / res.seconds if res.seconds else float("nan")
    print(f"rank {res.rank}/{res.world_size}: {res.sequences} sequences, {res.tokens} tokens in "
          f"{res.seconds:.1f} s ({rate:.1f} seq/s); resumed at batch {res.resumed_at}/{res.batches}")
    if res.manifest is not None:
        print(f"cache ready: {args.out} ({res.manifest.num_sequences} sequences)")
    elif args.world_size > 1:
        print(f"when every rank is done: logitless refcache merge {args.out}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from .build import merge

    try:
        m = merge(args.path)
    except RefCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"cache ready: {args.path} ({m.num_sequences} sequences, {m.num_tokens} tokens)")
    return 0


def _info(args: argparse.Namespace) -> int:
    from .store import Store, manifest_summary

    try:
        d = manifest_summary(Store(args.path).manifest)
    except RefCacheError as e:
        print(f"error: {e}", file=sys.stderr)
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
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .store import Store

    try:
        Store(args.path, full_verify=True)
    except RefCacheError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(f"OK: {args.path}")
    return 0
