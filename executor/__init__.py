"""The GPU executor: owns weights, the paged KV pool and the swap pool, runs steps the scheduler plans.

Entry points: `ExecutorConfig` / `add_cli_args` (configuration), `serve` (blocking gRPC server),
`ExecutorServer` (a started server, for embedding and tests), `ModelRunner` (the step engine
without gRPC).
"""

from pagedserve.executor.config import ExecutorConfig, add_cli_args

__all__ = ["ExecutorConfig", "add_cli_args", "serve", "ExecutorServer", "ModelRunner"]


def __getattr__(name: str):
    # Lazy so that `from pagedserve.executor import ExecutorConfig` (CLI parsing) imports no model or grpc.
    if name in ("serve", "ExecutorServer"):
        from pagedserve.executor import service

        return getattr(service, name)
    if name == "ModelRunner":
        from pagedserve.executor.runner import ModelRunner

        return ModelRunner
    raise AttributeError(name)
