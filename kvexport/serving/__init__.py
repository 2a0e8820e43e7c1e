"""`kvexport serve OUT`: a built package behind a Triton Inference Server, one user per request.

    signature   what a request and its response hold (also printed by `kvexport inspect`)
    batcher     merges concurrent requests of distinct users into one jagged batch of the package
    metrics     kvexport's counters (cache, batches) in Prometheus text, served with Triton's own
    triton      the server: PyTriton's tritonserver, the bound model, readiness, drain on SIGTERM

Only `triton` needs the `serve` extra (nvidia-pytriton); importing this package imports neither
torch nor pytriton.
"""
