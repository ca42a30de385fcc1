"""Reference log-prob cache: compute a frozen reference model's token log-probs over a
fixed dataset once (no-grad, no logits materialized), store them memory-mapped with a
manifest that fingerprints what they depend on, free the model, and serve rows at train time.

Flow::

    from logitless.refcache import BuildOptions, RefCache, build, free_reference

    build(ref_model, records, "ref-cache", tokenizer=tok, options=BuildOptions(temperature=0.9))
    free_reference(ref_model)
    cache = RefCache.open("ref-cache", model=policy, tokenizer=tok, temperature=0.9)
    ref_logps = cache.ref_logps_for(prompt_ids, prompt_mask, completion_ids, completion_mask)

See ``docs/refcache.md`` for alignment, format and integrity guarantees.
"""

from .build import BuildOptions, BuildResult, build, merge
from .cache import RefCache
from .dataset import Example, load_records
from .errors import (
    RefCacheCorruptError,
    RefCacheError,
    RefCacheLockedError,
    RefCacheMismatchError,
    RefCacheMissError,
    RefCacheWriteError,
)
from .fingerprint import Fingerprint, Manifest, sequence_key, tokenizer_fingerprint, weights_fingerprint
from .model import ReferenceModel, free_reference
from .store import PartWriter, finalize

__all__ = [
    "BuildOptions",
    "BuildResult",
    "Example",
    "Fingerprint",
    "Manifest",
    "PartWriter",
    "RefCache",
    "RefCacheCorruptError",
    "RefCacheError",
    "RefCacheLockedError",
    "RefCacheMismatchError",
    "RefCacheMissError",
    "RefCacheWriteError",
    "ReferenceModel",
    "build",
    "finalize",
    "free_reference",
    "load_records",
    "merge",
    "sequence_key",
    "tokenizer_fingerprint",
    "weights_fingerprint",
]
