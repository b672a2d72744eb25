"""Executor config, CLI flags and KV pool sizing arithmetic (no model needed)."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedserve.executor.config import ExecutorConfig, add_cli_args
from pagedserve.executor.kv_cache import (
    KVCache,
    KVCacheLayout,
    KVCacheTooSmallError,
    check_fits,
    cpu_device_num_blocks,
    gpu_num_blocks,
)


def test_cli_flags_map_onto_config():
    parser = add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(
        "--model m --port 0 --dtype bfloat16 --device cpu --max-model-len 128 --block-size 32 "
        "--gpu-memory-utilization 0.5 --num-gpu-blocks-override 10 --swap-space 1.5 "
        "--max-num-batched-tokens 512 --max-num-seqs 8 --enforce-eager".split()
    )
    config = ExecutorConfig.from_args(ns)
    assert config == ExecutorConfig(
        model="m", port=0, dtype="bfloat16", device="cpu", max_model_len=128, block_size=32,
        gpu_memory_utilization=0.5, num_gpu_blocks_override=10, swap_space=1.5,
        max_num_batched_tokens=512, max_num_seqs=8, enforce_eager=True,
    )  # fmt: skip
    assert config.torch_dtype(torch.device("cpu")) == torch.bfloat16


def test_cli_without_endpoint_flags_takes_overrides():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=50051)  # a parent CLI's own endpoint flags
    parser.add_argument("--model")
    add_cli_args(parser, endpoint=False)
    ns = parser.parse_args(["--model", "m"])
    config = ExecutorConfig.from_args(ns, port=50061)
    assert (config.model, config.port, config.host) == ("m", 50061, "127.0.0.1")
    assert config.torch_device() == torch.device("cpu") or torch.cuda.is_available()
    assert ExecutorConfig(model="m", device="cpu").torch_dtype(torch.device("cpu")) == torch.float32


def test_invalid_config_lists_every_problem():
    with pytest.raises(ValueError) as err:
        ExecutorConfig(model="m", block_size=24, gpu_memory_utilization=1.5, dtype="int8", max_num_seqs=0)
    message = str(err.value)
    for word in ("block_size", "gpu_memory_utilization", "dtype", "max_num_seqs"):
        assert word in message


def test_bad_flag_values_exit_as_argparse_does_naming_the_flags(capsys):
    """`pagedserve executor --block-size 24` (and the scheduler's flags): a usage error, exit 2,
    in the words of the flags, not a ValueError traceback."""
    from pagedserve.scheduler.service_config import ServiceConfig

    parser = add_cli_args(argparse.ArgumentParser(prog="pagedserve executor"))
    ns = parser.parse_args("--model m --block-size 24 --gpu-memory-utilization 1.5 --swap-space -1".split())
    with pytest.raises(SystemExit) as exit_info:
        ExecutorConfig.from_args(ns)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedserve executor: error:")
    for flag in ("--block-size", "--gpu-memory-utilization", "--swap-space"):
        assert flag in err

    scheduler = argparse.ArgumentParser(prog="pagedserve scheduler")
    ServiceConfig.add_cli_args(scheduler)
    ns = scheduler.parse_args("--model m --max-num-seqs 64 --max-num-batched-tokens 32".split())
    with pytest.raises(SystemExit) as exit_info:
        ServiceConfig.from_args(ns, parser=scheduler)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pagedserve scheduler" in err
    assert "--max-num-batched-tokens (32) must be >= --max-num-seqs" in err


LAYOUT = KVCacheLayout(layers_per_block=2, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_pool_sizing():
    assert LAYOUT.bytes_per_block == 2 * 2 * 16 * 2 * 8 * 4
    # CPU: the space, capped at max_num_seqs full-length sequences.
    assert cpu_device_num_blocks(LAYOUT, 100 * LAYOUT.bytes_per_block, max_num_seqs=4, max_model_len=64) == 16
    assert cpu_device_num_blocks(LAYOUT, 10 * LAYOUT.bytes_per_block, max_num_seqs=4, max_model_len=64) == 10
    # CUDA: utilization x total minus profiled peak and non-torch memory.
    total = 1000 * LAYOUT.bytes_per_block
    assert (
        gpu_num_blocks(LAYOUT, total, 0.5, 200 * LAYOUT.bytes_per_block, 50 * LAYOUT.bytes_per_block) == 250
    )
    assert gpu_num_blocks(LAYOUT, total, 0.1, total, 0) == 0
    # Memory in use at the start (another executor on the GPU, the CUDA context) is not this
    # executor's: a 0.5 share is still 500 blocks' worth...
    block = LAYOUT.bytes_per_block
    assert gpu_num_blocks(LAYOUT, total, 0.5, 200 * block, 50 * block, in_use_at_start=450 * block) == 250
    # ...unless less than that was free: then it gets what was free.
    assert gpu_num_blocks(LAYOUT, total, 1.0, 200 * block, 50 * block, in_use_at_start=100 * block) == 650
    with pytest.raises(KVCacheTooSmallError, match="largest length that fits is 48"):
        check_fits(LAYOUT, 3, 100, why="test")
    check_fits(LAYOUT, 7, 100, why="test")


def test_swap_moves_blocks_between_pools():
    cache = KVCache(LAYOUT, num_device_blocks=6, num_cpu_blocks=4, device=torch.device("cpu"))
    cache.device_pool.copy_(torch.randn_like(cache.device_pool))
    original = cache.device_pool.clone()
    cache.swap_out([5, 1, 2], [0, 1, 3])  # CPU blocks 0-1 are one run, 3 another
    assert cache.cpu_pool.shape == (4, *original[:, :, 0].shape)  # block-major
    torch.testing.assert_close(cache.cpu_pool[1], original[:, :, 1], rtol=0, atol=0)
    cache.swap_in([3, 0, 1], [2, 4, 0])
    for device_block, original_block in ((2, 2), (4, 5), (0, 1)):
        torch.testing.assert_close(
            cache.device_pool[:, :, device_block], original[:, :, original_block], rtol=0, atol=0
        )
    untouched = [1, 3, 5]
    torch.testing.assert_close(cache.device_pool[:, :, untouched], original[:, :, untouched], rtol=0, atol=0)
    k, v = cache.layer_caches()[1]
    assert k.shape == (6, 16, 2, 8)
    assert k.is_contiguous()
    assert v.is_contiguous()
