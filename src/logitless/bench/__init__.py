"""``logitless bench``: fused-head objectives against the cuBLAS floor and other libraries.

Modules: :mod:`.cases` (shapes, realistic inputs), :mod:`.plain` (the plain path's math),
:mod:`.competitors` (one function per row), :mod:`.timing`, :mod:`.runner`, :mod:`.report`
(JSON, ``BENCHMARKS.md``, plot), :mod:`.cli`.
"""
