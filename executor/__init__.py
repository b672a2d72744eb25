"""The GPU executor: owns weights, the paged KV pool and the swap pool, runs steps the scheduler plans.

Entry points: `ExecutorConfig` / `add_cli_args` (configuration), `serve` (blocking gRPC server),
`ExecutorServer` (a started server, for embedding and tests), `ModelRunner` (the step engine
without gRPC).
"""

from executor.config import ExecutorConfig, add_cli_args

__all__ = ["ExecutorConfig", "add_cli_args", "serve", "ExecutorServer", "ModelRunner"]


def __getattr__(name: str):
    # Lazy so that `from executor import ExecutorConfig` (CLI parsing) does not import torch models / grpc.
    if name in ("serve", "ExecutorServer"):
        from executor import service

        return getattr(service, name)
    if name == "ModelRunner":
        from executor.runner import ModelRunner

        return ModelRunner
    raise AttributeError(name)
