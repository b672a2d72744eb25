"""Which executor a new (or re-placed) request goes to: pure policy over numbers the engine gathers.

The scheduler owns every executor's block table, so it knows, exactly, how many of a request's full
prompt blocks are already cached on each executor, or will be once the requests queued there start
(`hit_blocks`: requests that arrive together with a common prefix follow the first one, which
computes it): routers in front of engines that schedule themselves can only approximate this
(SGLang's router keeps an approximate radix tree of the text it sent each worker; llm-d's "precise"
scorer subscribes to each engine's KV events, which only report blocks already computed).

Policy `prefix` (the default) picks the executor of least estimated cost, in tokens of work that
stand between the request and its first token::

    cost(e) = (T - hit_blocks(e) * block_size)       # prompt tokens it must compute there
            + CPU_TIER_TOKEN_COST * block_size * cpu_hit_blocks(e)
                                                      # of the hit, blocks loaded from the CPU tier
            + queued_tokens(e)                        # prefill of requests waiting there (a shared
                                                      #   prefix counted once)
            + DECODE_TOKEN_WEIGHT * num_running(e)    # decodes sharing every step with it
            + block_size * blocks_short(e)            # blocks it would wait for (or pre-empt)
            + block_size * (max_hit - hit_blocks(e))  # blocks the pool would compute a second time

where T is the request's known tokens and max_hit the best hit of any executor. A hit in an
executor's CPU tier (`--kv-offloading-size`) costs bandwidth, not FLOPs: loading a block's KV over
PCIe takes about a fifth of the time computing its tokens does (Llama-3.1-8B: 2 MiB per block at
~25 GB/s, ~80 us, against ~0.4 ms of prefill at ~600 TFLOP/s), so such a block counts as a fifth
of a miss (CPU_TIER_TOKEN_COST). The last term is the
work a miss adds to the pool as a whole: an executor that recomputes a prefix another one holds
spends that time on no one else, so a miss costs its blocks twice, once in this request's wait and
once as work done again. A one-block hit is thus worth two running requests less
(DECODE_TOKEN_WEIGHT = block_size): affinity wins while loads are comparable, and load wins once
they are not. (Without the last term, on W4 over 3 executors, a request went elsewhere as soon as
the home of its prefix had one request more queued than another executor: prefixes grew second and
third homes and were computed again.)

**The bound against a hot prefix.** A prefix shared by most requests would otherwise draw them all
to the one executor that cached it first (its hit always outweighs a few waiting requests). So an
executor is a candidate only while its load (running + waiting requests) stays within
`HOT_LOAD_FACTOR * min_load + HOT_LOAD_MARGIN` of the least-loaded executor's: past that, the
request goes elsewhere and computes the prefix there, which then becomes a second home for it.
The least-loaded executor is always a candidate, so a request always has a home.

Ties (equal cost, e.g. idle executors and no hit) are broken round robin, so an idle pool spreads
requests instead of piling them on the first executor.

`round_robin` ignores load and cache (the W4 baseline); `least_loaded` is `prefix` without the hit
term and without the bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROUTING_POLICIES = ("prefix", "round_robin", "least_loaded")

# Tokens of cost per running request: one block's worth (see the module docstring).
DECODE_TOKEN_WEIGHT = 16
# What a token of a hit in the CPU tier costs, against 1 for a token computed (the module docstring).
CPU_TIER_TOKEN_COST = 0.2
# An executor whose load exceeds the least-loaded one's by more than this is no candidate.
HOT_LOAD_FACTOR = 1.5
HOT_LOAD_MARGIN = 4


@dataclass(frozen=True, slots=True)
class ExecutorLoad:
    """What the router knows of one attached executor when a request arrives.

    Attributes:
        num_running: requests holding blocks there.
        num_waiting: requests queued there (waiting or swapped out).
        queued_tokens: tokens its queued requests still have to compute.
        num_free_blocks: free GPU blocks (cached free ones included: they can be evicted).
        block_size: tokens per block.
        hit_blocks: the request's leading full prompt blocks whose hash chain is cached there (GPU
            pool or CPU tier), or is the prefix of a request queued there.
        cpu_hit_blocks: of those, the blocks its CPU tier would load.
    """

    num_running: int
    num_waiting: int
    queued_tokens: int
    num_free_blocks: int
    block_size: int
    hit_blocks: int = 0
    cpu_hit_blocks: int = 0

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cost(num_tokens: int, executor: ExecutorLoad, use_hit: bool = True, max_hit: int = 0) -> float:
    """The estimated tokens of work ahead of the request's first token on `executor`, plus the
    blocks of the best hit elsewhere (`max_hit`) it would compute again (see the module docstring)."""
    hit = executor.hit_blocks if use_hit else 0
    loaded = executor.cpu_hit_blocks if use_hit else 0
    size = executor.block_size
    blocks_needed = _cdiv(num_tokens + 1, size) - hit
    blocks_short = max(0, blocks_needed - executor.num_free_blocks)
    return (
        num_tokens
        - hit * size
        + CPU_TIER_TOKEN_COST * loaded * size
        + executor.queued_tokens
        + DECODE_TOKEN_WEIGHT * executor.num_running
        + size * blocks_short
        + size * max(0, max_hit - hit)
    )


def within_hot_bound(executor: ExecutorLoad, min_load: int) -> bool:
    """Whether `executor` is close enough in load to the least-loaded one to be chosen."""
    return executor.load <= HOT_LOAD_FACTOR * min_load + HOT_LOAD_MARGIN


class Router:
    """Chooses an executor per request; the only state is the round-robin position."""

    def __init__(self, policy: str = "prefix") -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.policy = policy
        self._next = 0

    def choose(self, num_tokens: int, executors: Sequence[ExecutorLoad]) -> int:
        """The index in `executors` (non-empty) of the executor for a request of `num_tokens`
        known tokens."""
        if not executors:
            raise ValueError("no executor to choose from")
        n = len(executors)
        start = self._next % n
        self._next = start + 1
        if self.policy == "round_robin":
            return start
        use_hit = self.policy == "prefix"
        min_load = min(e.load for e in executors)
        max_hit = max(e.hit_blocks for e in executors) if use_hit else 0
        best, best_cost = -1, 0.0
        for offset in range(n):  # from the round-robin position: ties go round robin
            i = (start + offset) % n
            executor = executors[i]
            if use_hit and not within_hot_bound(executor, min_load):
                continue
            c = cost(num_tokens, executor, use_hit, max_hit)
            if best < 0 or c < best_cost:
                best, best_cost = i, c
        return best
