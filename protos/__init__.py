"""The two gRPC contracts of pagedserve and their generated Python stubs.

`pagedserve/v1/generation.proto` is the public API; `pagedserve/v1/executor.proto` is the internal
scheduler <-> executor protocol. Regenerate the stubs with `python -m pagedserve.protos.generate`.
"""
