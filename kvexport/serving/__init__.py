"""Serving a built package through a Triton Inference Server, one user per request.

    signature       what a request and its response hold (also printed by `kvexport inspect`)
    repository      `kvexport triton-repo`: a standard Triton model repository for an artifact
    triton_model    the repository's model.py (Python backend): load, warm up, score, route, metrics
    triton_router   with several shards, the routing rules: each user to one shard's cache, packs, keys
    batcher         merges concurrent requests of distinct users into one jagged batch of the package
    warmup          the package loaded for serving: warmed up, then the remote tier attached
    metrics         kvexport's counters (cache, batches), published on Triton's metrics port
    tritonserver    the serve extra's tritonserver binary, laid out to run a repository (REPO/tritonserver)
    triton          `kvexport serve`: that repository under that tritonserver, drained on SIGTERM

Running a server needs the `serve` extra (its tritonserver); importing this package imports
neither torch nor it.
"""
