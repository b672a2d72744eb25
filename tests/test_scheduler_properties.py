"""Stateful property test: random arrivals, steps (outputs on time or one step late), aborts and
preemptions against a fake executor that stores each token id in its KV slot, for models of one
full-attention KV-cache group and of several groups with sliding windows (whose blocks the scheduler
releases once no query can see them).

The fake executor applies plans exactly as the protocol says (the disk tier's spill and fetch,
swap_out, removed, swap_in, the CPU tier's offload and load, then the forward pass: every scheduled
token's KV written before any is read, then sampling; the tier's copies run beside the forward on a
copy stream, so the forward must neither write an offloaded block nor read or write a loaded one)
and checks that every token it is asked to compute has a slot, that a write into a block another
live sequence holds puts there the very token that sequence has at that position (a request
admitted in the step that computes a shared prefix reads it, as in the real executor), and that
every position a query of every live sequence can see (prefix-cache hits, shared in the same step
or earlier, and swapped-in blocks included; within the window, in a sliding group) holds the right
token, in every group. The scheduler's block bookkeeping is checked after every rule.

With speculative decoding (n-gram proposals or a draft model's, some runs), the fake executor
writes each proposal's token into its slot (its fake draft proposes what it will sample, but every
third token wrong), accepts the proposals that equal what it samples, and trims its tables as the
protocol says (a draft model's verification keeps the next one's lookahead slots): a registered
block or a visible slot holding a rejected proposal fails the checks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.common.kv_sizing import blocks_per_sequence
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.scheduler.block_pool import BlockHash, hash_block_tokens
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.core import Scheduler, StepPlan
from pagedserve.scheduler.request import Request, RequestStatus, SamplingOptions, SeqId

# Prompts start with a prefix of one of these, so prefixes (and cached blocks) repeat.
TEMPLATES = (
    tuple(range(1, 17)),
    (1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7, 8, 9, 10, 11, 12),
    (5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5),
)


def sampled_token(seq_id: int, position: int) -> int:
    """What the fake model samples: deterministic, so recomputation samples the same tokens, and
    from a tiny alphabet, so generated blocks repeat across requests too."""
    return 20 + (seq_id + position) % 3


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# KV-cache groups: one per entry, None for full attention, else the sliding window.
GROUPS = ((None,), (None,), (2,), (3,), (None, 2), (None, 3, 3), (5, None))


@dataclass
class _Seq:
    tokens: list[int]
    tables: list[list[int | None]]  # per group, positional: None before a sliding group's window
    computed: int


class FakeExecutor:
    """Keeps a token id per KV slot instead of K and V tensors."""

    def __init__(self, config: SchedulerConfig, truth: dict[int, list[int]], prompt_lens: dict[int, int]):
        self.block_size = config.block_size
        self.windows = config.sliding_windows
        self.max_model_len = config.max_model_len
        spec = config.speculative
        self.lookahead = 0 if spec is None else spec.num_lookahead_slots
        self.gpu: list[list[int | None]] = [[None] * config.block_size for _ in range(config.num_gpu_blocks)]
        self.cpu: list[list[int | None]] = [[None] * config.block_size for _ in range(config.num_cpu_blocks)]
        self.disk: list[list[int | None]] = [
            [None] * config.block_size for _ in range(config.num_disk_offload_blocks)
        ]
        self.seqs: dict[int, _Seq] = {}
        self.truth = truth  # seq id -> prompt + every token sampled for it so far
        self.prompt_lens = prompt_lens
        self.max_tokens: dict[int, int] = {}
        self.prompt_tokens_computed = 0  # prompt tokens of every plan executed (recomputes count again)

    def slot(self, seq: _Seq, group: int, position: int) -> int | None:
        block = seq.tables[group][position // self.block_size]
        assert block is not None, f"position {position} of group {group} has no block"
        return self.gpu[block][position % self.block_size]

    def first_visible(self, group: int, position: int) -> int:
        """The first position a query at `position` sees in `group`."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1)

    def check_visible(
        self, seq_id: int, seq: _Seq, query_start: int, end: int, tokens: list[int] | None = None
    ) -> None:
        """Queries at positions [query_start, end) read the right tokens in every group (`tokens`:
        the sequence's, proposals included; default its own)."""
        tokens = seq.tokens if tokens is None else tokens
        for group in range(len(self.windows)):
            for p in range(self.first_visible(group, query_start), end):
                assert self.slot(seq, group, p) == tokens[p], f"seq {seq_id} group {group} position {p}"

    def execute(self, plan: StepPlan) -> tuple[list[int], list[int], list[int]]:
        num_gpu, num_cpu, num_disk = len(self.gpu), len(self.cpu), len(self.disk)
        for src, dst in plan.spill:  # the disk tier's moves first: spills, then fetches
            assert 0 <= src < num_cpu and 0 <= dst < num_disk, (src, dst)
            self.disk[dst] = list(self.cpu[src])
        for src, dst in plan.fetch:
            assert 0 <= src < num_disk and 0 <= dst < num_cpu, (src, dst)
            self.cpu[dst] = list(self.disk[src])
        for src, dst in plan.spill_ahead:  # beside the step: no other move of the plan touches them
            assert 0 <= src < num_cpu and 0 <= dst < num_disk, (src, dst)
            self.disk[dst] = list(self.cpu[src])
        ahead_hosts, ahead_slots = {src for src, _ in plan.spill_ahead}, {dst for _, dst in plan.spill_ahead}
        assert not ahead_slots & ({dst for _, dst in plan.spill} | {src for src, _ in plan.fetch})
        others = [dst for _, dst in plan.fetch] + [src for src, _ in plan.spill]
        others += [cpu for move in (plan.swap_out, plan.offload) for _, cpu in move]
        others += [cpu for move in (plan.swap_in, plan.load) for cpu, _ in move]
        assert not ahead_hosts & set(others), "a host block spilled ahead is moved by its plan"
        for src, dst in plan.swap_out:
            assert 0 <= src < num_gpu, (src, dst)
            assert 0 <= dst < num_cpu, (src, dst)
            self.cpu[dst] = list(self.gpu[src])
        for seq_id in plan.removed_seq_ids:
            assert seq_id in self.seqs, f"removing seq {seq_id} the executor does not hold"
            del self.seqs[seq_id]
        for seq in self.seqs.values():  # table entries no query reads again may be stale: forget them
            for group, table in enumerate(seq.tables):
                for i in range(self.first_visible(group, seq.computed) // self.block_size):
                    table[i] = None
        held = Counter(b for seq in self.seqs.values() for t in seq.tables for b in t if b is not None)
        for src, dst in plan.swap_in:
            assert 0 <= src < num_cpu, (src, dst)
            assert 0 <= dst < num_gpu, (src, dst)
            assert held[dst] == 0, f"swap_in overwrites block {dst} held by a live sequence"
            self.gpu[dst] = list(self.cpu[src])
        for src, dst in plan.offload:  # the copy stream, behind the swaps above
            assert 0 <= src < num_gpu and 0 <= dst < num_cpu, (src, dst)
            self.cpu[dst] = list(self.gpu[src])
        for src, dst in plan.load:
            assert 0 <= src < num_cpu and 0 <= dst < num_gpu, (src, dst)
            assert held[dst] == 0, f"a load overwrites block {dst} held by a live sequence"
            self.gpu[dst] = list(self.cpu[src])
        beside = {src for src, _ in plan.offload} | {dst for _, dst in plan.load}  # not this forward's

        scheduled: list[tuple[int, _Seq, int]] = []
        drafts: dict[int, list[int]] = {}  # speculative decoding: each verified request's proposals
        for new in plan.new_requests:
            assert new.seq_id not in self.seqs
            assert new.token_ids == self.truth[new.seq_id], "a new request must carry every known token"
            assert 0 <= new.num_computed_tokens < len(new.token_ids)
            assert new.num_new_tokens >= 1
            assert new.num_computed_tokens + new.num_new_tokens <= len(new.token_ids)
            assert len(new.block_tables) == len(self.windows)
            tables = [[None] * first + list(ids) for first, ids in new.block_tables]
            assert all(0 <= b < num_gpu for t in tables for b in t if b is not None)
            seq = _Seq(list(new.token_ids), tables, new.num_computed_tokens)
            self.seqs[new.seq_id] = seq
            scheduled.append((new.seq_id, seq, new.num_new_tokens))
        for running in plan.running:
            seq = self.seqs[running.seq_id]
            if running.new_blocks:
                assert len(running.new_blocks) == len(self.windows)
            for table, (first, ids) in zip(seq.tables, running.new_blocks, strict=False):
                assert first == len(table), "new blocks are appended at the table's end"
                assert all(0 <= b < num_gpu for b in ids)
                table.extend(ids)
            assert running.num_new_tokens >= 1
            num_draft = running.num_draft_tokens
            assert num_draft < running.num_new_tokens
            if self.lookahead and num_draft:  # the draft model's proposals: every third one wrong
                assert not running.draft_token_ids
                position = len(seq.tokens)
                drafts[running.seq_id] = [
                    sampled_token(running.seq_id, p) if (running.seq_id + p) % 3 else 0
                    for p in range(position, position + num_draft)
                ]
            elif num_draft:
                assert len(running.draft_token_ids) == num_draft
                drafts[running.seq_id] = list(running.draft_token_ids)
            else:
                assert not running.draft_token_ids
            if num_draft:
                assert seq.computed + running.num_new_tokens - num_draft == len(seq.tokens), (
                    "proposals follow"
                )
            else:
                assert seq.computed + running.num_new_tokens <= len(seq.tokens), "computing an unknown token"
            scheduled.append((running.seq_id, seq, running.num_new_tokens))
        assert len({seq_id for seq_id, _, _ in scheduled}) == len(scheduled)

        holders: dict[int, list[tuple[_Seq, int]]] = {}
        for seq_id, seq in self.seqs.items():
            held_ids = [b for t in seq.tables for b in t if b is not None]
            assert len(set(held_ids)) == len(held_ids), f"seq {seq_id} holds a block twice"
            for group, table in enumerate(seq.tables):
                for b in table:
                    if b is not None:
                        holders.setdefault(b, []).append((seq, group))
        for seq_id, seq, num_new in scheduled:  # write_kv: every new token, before any read
            end = seq.computed + num_new
            tokens = seq.tokens + drafts.get(seq_id, [])
            most = cdiv(min(end + self.lookahead, self.max_model_len), self.block_size)
            for group, table in enumerate(seq.tables):
                assert cdiv(end, self.block_size) <= len(table) <= most, (
                    f"seq {seq_id}: blocks do not fit its tokens"
                )
                for p in range(seq.computed, end):
                    block = table[p // self.block_size]
                    assert block is not None, f"seq {seq_id} group {group}: no block for new position {p}"
                    assert block not in beside, f"seq {seq_id} writes block {block} a copy of this step moves"
                    for other, other_group in holders[block]:  # a shared block gets only its own tokens
                        assert other_group == group, f"block {block} shared by two groups"
                        q = other.tables[group].index(block) * self.block_size + p % self.block_size
                        assert other is seq or q >= len(other.tokens) or other.tokens[q] == tokens[p], (
                            f"seq {seq_id} writes into block {block} a token another sequence does not have"
                        )
                    self.gpu[block][p % self.block_size] = tokens[p]
        loaded = {dst for _, dst in plan.load}
        for seq_id, seq, num_new in scheduled:  # attention of this step's queries
            tokens = seq.tokens + drafts.get(seq_id, [])
            read = {b for t in seq.tables for b in t if b is not None}
            assert not read & loaded, f"seq {seq_id} reads a block this step loads beside its forward"
            self.check_visible(seq_id, seq, seq.computed, seq.computed + num_new, tokens)
        for seq_id, seq, num_new in scheduled:
            self.prompt_tokens_computed += max(0, min(self.prompt_lens[seq_id] - seq.computed, num_new))
            seq.computed += num_new

        out_ids, out_tokens, counts = [], [], []
        for seq_id, seq, _ in scheduled:
            proposed = drafts.get(seq_id, [])
            if seq.computed - len(proposed) == len(seq.tokens):
                # Verification: proposals are accepted while they are what the model samples.
                run: list[int] = []
                for proposal in [*proposed, None]:
                    token = sampled_token(seq_id, len(seq.tokens) + len(run))
                    run.append(token)
                    if proposal != token:
                        break
                seq.computed -= len(proposed) - (len(run) - 1)
                for table in seq.tables:  # trimmed to the block of the last computed token (or slot ahead)
                    del table[cdiv(seq.computed + self.lookahead, self.block_size) :]
                seq.tokens += run
                truth = self.truth[seq_id]
                if len(truth) < len(seq.tokens):
                    truth += seq.tokens[len(truth) :]
                assert truth[: len(seq.tokens)] == seq.tokens
                assert len(seq.tokens) - self.prompt_lens[seq_id] <= self.max_tokens[seq_id], "max_tokens"
                out_ids.append(seq_id)
                out_tokens += run
                counts.append(len(run))
        for seq_id, seq in self.seqs.items():  # what the next query will see, shared blocks too
            self.check_visible(seq_id, seq, seq.computed, seq.computed)
        assert out_ids == plan.sampling_seq_ids
        return out_ids, out_tokens, counts


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        max_model_len=st.sampled_from([6, 8, 12, 16]),
        extra_blocks=st.integers(0, 4),
        num_cpu_blocks=st.integers(0, 8),
        max_num_seqs=st.integers(1, 6),
        max_num_batched_tokens=st.integers(1, 20),
        enable_prefix_caching=st.booleans(),
        preemption_mode=st.sampled_from(["recompute", "swap"]),
        sliding_windows=st.sampled_from(GROUPS),
        tier_share=st.sampled_from([0.0, 0.0, 0.5, 1.0]),
        num_disk_offload_blocks=st.sampled_from([0, 0, 1, 3, 8]),
        num_speculative_tokens=st.sampled_from([0, 1, 3, 3]),
        spec_method=st.sampled_from(["ngram", "draft_model"]),
        max_num_loaded_blocks=st.sampled_from([0, 1, 1, 2]),
    )
    def setup(
        self,
        block_size,
        max_model_len,
        extra_blocks,
        sliding_windows,
        max_num_batched_tokens,
        tier_share,
        num_speculative_tokens,
        spec_method="ngram",
        **rest,
    ):
        spec = None
        if num_speculative_tokens and spec_method == "ngram":  # (the fake model's tokens repeat)
            spec = SpeculativeConfig(
                "ngram", num_speculative_tokens, prompt_lookup_max=2, prompt_lookup_min=1
            )
        elif num_speculative_tokens:  # the fake executor's draft: FakeExecutor.execute
            spec = SpeculativeConfig("draft_model", num_speculative_tokens, model="draft")
        needed = blocks_per_sequence(max_model_len, block_size, sliding_windows, max_num_batched_tokens)
        self.config = SchedulerConfig(
            block_size=block_size,
            max_model_len=max_model_len,
            num_gpu_blocks=needed + extra_blocks,
            sliding_windows=sliding_windows,
            max_num_batched_tokens=max_num_batched_tokens,
            # A CPU tier of the prefix cache on part or all of the host pool (scheduler.kv_tier).
            num_cpu_offload_blocks=int(tier_share * rest["num_cpu_blocks"]),
            speculative=spec,
            **rest,
        )
        self.scheduler = Scheduler(self.config)
        self.truth: dict[int, list[int]] = {}
        self.prompt_lens: dict[int, int] = {}
        self.executor = FakeExecutor(self.config, self.truth, self.prompt_lens)
        self.requests: dict[int, Request] = {}  # every request ever added
        self.held: tuple[int, list[int], list[int], list[int]] | None = None  # an output one step late
        self.fetched_hosts: set[int] = set()  # host blocks the last plan fetched from disk into
        self.next_seq_id = 1
        self.known_hashes: dict[BlockHash, list[int]] = {}

    # ---- rules -------------------------------------------------------------------------------

    @rule(
        template=st.integers(0, len(TEMPLATES) - 1),
        prefix_len=st.integers(0, 16),
        tail=st.lists(st.integers(0, 1), max_size=3),
        max_tokens_frac=st.floats(0, 1),
        priority=st.integers(0, 2),
    )
    def add_request(self, template, prefix_len, tail, max_tokens_frac, priority) -> None:
        prompt = (list(TEMPLATES[template][:prefix_len]) + tail)[: self.config.max_model_len - 1] or [0]
        room = self.config.max_model_len - len(prompt)
        max_tokens = 1 + int(max_tokens_frac * (room - 1))
        seq_id = self.next_seq_id
        self.next_seq_id += 1
        request = Request(SeqId(seq_id), prompt, max_tokens, SamplingOptions(), priority=priority)
        self.truth[seq_id] = list(prompt)
        self.prompt_lens[seq_id] = len(prompt)
        self.executor.max_tokens[seq_id] = max_tokens
        self.requests[seq_id] = request
        self.scheduler.add_request(request)

    @rule(late=st.booleans())
    def step(self, late: bool) -> None:
        """schedule() for step N+1, then the output of step N arrives (as the engine does)."""
        plan = self.scheduler.schedule()
        self.check_plan(plan)
        output = (plan.step_id, *self.executor.execute(plan))
        self.deliver_held()
        if late:
            self.held = output
        else:
            self.deliver(output)

    @precondition(lambda self: self.held is not None)
    @rule()
    def deliver_held(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            self.deliver(held)

    @rule(index=st.integers(0, 1_000), also_late=st.booleans())
    def abort(self, index: int, also_late: bool) -> None:
        """A stop condition or a cancelled client, at any point of a request's life."""
        live = [r for r in self.requests.values() if r.status is not RequestStatus.FINISHED]
        if not live:
            return
        request = live[index % len(live)]
        self.scheduler.abort_request(request.seq_id)
        assert request.status is RequestStatus.FINISHED
        assert self.scheduler.get_request(request.seq_id) is None
        self.scheduler.abort_request(request.seq_id)  # idempotent

    # ---- helpers -------------------------------------------------------------------------------

    def deliver(self, output: tuple[int, list[int], list[int], list[int]]) -> None:
        step_id, seq_ids, tokens, counts = output
        live_before = {s for s in seq_ids if self.scheduler.get_request(SeqId(s)) is not None}
        updated = self.scheduler.process_output(step_id, seq_ids, tokens, counts)
        assert [r.seq_id for r in updated] == [s for s in seq_ids if s in live_before]
        for request in updated:
            assert request.num_pending_outputs >= 0
            if len(request.output_token_ids) == request.max_tokens:
                assert request.status is RequestStatus.FINISHED

    def check_plan(self, plan: StepPlan) -> None:
        config = self.config
        assert plan.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(self.scheduler.running) + len(self.scheduler.loading) <= config.max_num_seqs
        scheduled = [p.seq_id for p in (*plan.new_requests, *plan.running)]
        assert len(set(scheduled)) == len(scheduled)
        assert not set(plan.removed_seq_ids) & set(scheduled), (
            "a request is never removed and run in one plan"
        )
        assert len(set(plan.removed_seq_ids)) == len(plan.removed_seq_ids)
        # swap_out runs first: it must not overwrite a CPU block this plan's swap_in reads, unless
        # both are the CPU tier's (a block evicted to the tier and hit there in one step: the load
        # reads what the offload wrote).
        tier = self.scheduler.kv_cache_manager.tier
        tier_slots = {slot for _, slot in tier.items()} if tier is not None else set()
        assert {cpu for _, cpu in plan.swap_out} & {cpu for cpu, _ in plan.swap_in} <= tier_slots
        # The tier's loads stay within the budget, except a plan's first tier hit's (it goes alone),
        # or the loads of the disk blocks the plan before fetched alone: they counted against that
        # plan's budget, and load even if their request was aborted since (they are registered).
        if config.max_num_loaded_blocks and len(plan.load) > config.max_num_loaded_blocks:
            loaded = {gpu for _, gpu in plan.load}
            manager = self.scheduler.kv_cache_manager
            assert all(host in self.fetched_hosts for host, _ in plan.load) or any(
                loaded <= {b for g in range(manager.num_groups) for b in manager.block_ids(r.seq_id, g)}
                for r in self.scheduler.loading
            ), "a plan's loads past the budget are one request's"
        self.fetched_hosts = {host for _, host in plan.fetch}

    def chain_hashes(self, tokens: list[int]) -> None:
        """Records the hash of every full block of a token sequence, for the content check."""
        size, parent = self.config.block_size, None
        for i in range(len(tokens) // size):
            block = tokens[i * size : (i + 1) * size]
            parent = hash_block_tokens(parent, block)
            self.known_hashes.setdefault(parent, block)

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def block_bookkeeping(self) -> None:
        s, kv = self.scheduler, self.scheduler.kv_cache_manager
        pool, size = kv.block_pool, self.config.block_size
        free = pool.free_queue()
        free_ids = {b.block_id for b in free}
        holders: Counter[int] = Counter()
        for request in s.loading:  # admitted on a tier hit: its blocks (loaded, and its first chunk's)
            assert request.status is RequestStatus.LOADING
            assert request.num_pending_outputs == 0 and request.seq_id not in self.executor.seqs
            for group in range(kv.num_groups):
                holders.update(b.block_id for b in kv.blocks(request.seq_id, group) if b is not None)
        lookahead = self.executor.lookahead  # a draft model's verification: the next one's slots
        for request in s.running:
            most = cdiv(min(request.num_computed_tokens + lookahead, self.config.max_model_len), size)
            for group, window in enumerate(self.config.sliding_windows):
                table = kv.blocks(request.seq_id, group)
                assert cdiv(request.num_computed_tokens, size) <= len(table) <= most
                held = [b for b in table if b is not None]
                assert table[len(table) - len(held) :] == held, "only a table's head is released"
                if window is not None:  # at most the window, the last step's chunk and lookahead
                    chunk = self.config.max_num_batched_tokens + lookahead
                    extent = request.num_tokens + request.num_draft_tokens + lookahead  # (slots, too)
                    assert len(held) <= blocks_per_sequence(extent, size, (window,), chunk)
                holders.update(b.block_id for b in held)
                for i, block in enumerate(table):
                    if block is not None and block.block_hash is not None:  # full, known, its own hash
                        assert block.group == group
                        assert (i + 1) * size <= request.num_known_tokens
                        tokens = request.all_token_ids[: (i + 1) * size]
                        parent = None
                        for j in range(i + 1):
                            parent = hash_block_tokens(parent, tokens[j * size : (j + 1) * size])
                        assert block.block_hash == parent
        holders.update(b.block_id for b in self.scheduler.kv_cache_manager.held_for_loads)
        # Reference counts equal holders; free means unheld; the counts add up.
        for block in pool.blocks:
            assert block.ref_count == holders[block.block_id], block
            assert (block.ref_count == 0) == (block.block_id in free_ids), block
            if holders[block.block_id] > 1:
                assert block.block_hash is not None, "blocks are shared only through the prefix cache"
            if block.block_hash is not None:
                assert pool.get_cached_block(block.block_hash, block.group) is block
        assert len(free) + pool.num_blocks_in_use == pool.num_blocks
        assert pool.num_cached_free_blocks == sum(1 for b in free if b.block_hash is not None)
        assert pool.num_cached_blocks == sum(1 for b in pool.blocks if b.block_hash is not None)
        # Cached blocks hold the tokens their hash stands for.
        for tokens in self.truth.values():
            self.chain_hashes(tokens)
        pending = {b.block_id for b in self.scheduler.kv_cache_manager.held_for_loads}  # next plan's loads
        for block in pool.blocks:
            if block.block_hash is not None:
                assert block.block_hash in self.known_hashes
                if block.block_id not in pending:
                    assert self.executor.gpu[block.block_id] == self.known_hashes[block.block_hash]
        # Queues, statuses and CPU blocks.
        for request in s.waiting:
            assert request.status is RequestStatus.WAITING
            assert request.num_computed_tokens == 0
            assert kv.num_blocks(request.seq_id) == 0
        cpu_held = []
        for request in s.swapped:
            assert request.status is RequestStatus.SWAPPED
            assert kv.num_blocks(request.seq_id) == 0
            cpu = kv.cpu_block_ids(request.seq_id)
            computed = request.num_computed_tokens
            visible = [self.executor.first_visible(g, computed) // size for g in range(kv.num_groups)]
            assert len(cpu) == sum(cdiv(computed, size) - first for first in visible)
            cpu_held += cpu
        assert len(set(cpu_held)) == len(cpu_held)
        tier = [] if kv.tier is None else kv.tier.items()
        assert len(tier) <= self.config.num_cpu_offload_blocks
        assert not {slot for _, slot in tier} & set(cpu_held), "a host block serves one owner"
        assert len(cpu_held) + kv.num_free_cpu_blocks + len(tier) == self.config.num_cpu_blocks
        for (_, block_hash), slot in tier:  # the tier's host blocks hold the tokens of their hash
            assert block_hash in self.known_hashes
            assert self.executor.cpu[slot] == self.known_hashes[block_hash]
        disk = [] if kv.disk_tier is None else kv.disk_tier.items()
        assert len(disk) <= self.config.num_disk_offload_blocks
        assert len({slot for _, slot in disk}) == len(disk), "a disk slot holds one block"
        for (_, block_hash), slot in disk:  # and so do the disk tier's slots
            assert self.executor.disk[slot] == self.known_hashes[block_hash]
        live = [r for r in self.requests.values() if r.status is not RequestStatus.FINISHED]
        assert len(live) == len(s.waiting) + len(s.loading) + len(s.running) + len(s.swapped)
        assert s.has_unfinished_requests() == bool(live)
        stats = s.stats
        assert stats.gpu_blocks_in_use == pool.num_blocks_in_use <= stats.peak_gpu_blocks_in_use
        assert stats.cached_free_blocks == pool.num_cached_free_blocks
        assert 0.0 <= stats.slot_utilization <= 1.0
        assert 0.0 <= stats.peak_slot_utilization <= 1.0
        assert stats.prefix_cache_hit_tokens <= stats.prefix_cache_query_tokens

    @invariant()
    def prompt_tokens_counted_as_executed(self) -> None:
        """The scheduler counts a step's prompt tokens while it schedules them (and takes a
        pre-empted request's back); the total is what the executor computed."""
        assert self.scheduler.stats.prompt_tokens_computed == self.executor.prompt_tokens_computed

    @invariant()
    def request_counters(self) -> None:
        for seq_id, request in self.requests.items():
            # (proposals in flight count as computed until their output arrives)
            computed = request.num_computed_tokens - request.num_draft_tokens
            assert 0 <= computed <= request.num_tokens <= self.config.max_model_len
            assert request.num_sampled_tokens <= request.max_tokens
            assert 0 <= request.num_pending_outputs <= 2
            prompt_len = len(request.prompt_token_ids)
            outputs = request.output_token_ids
            assert outputs == self.truth[seq_id][prompt_len : prompt_len + len(outputs)]
            assert request.num_cached_prompt_tokens < prompt_len or prompt_len == 0

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        # Everything finishes: no deadlock, whatever the pool size and priorities.
        # Generous bound: each request needs at most max_model_len steps (at a budget of one token),
        # a few times over if pre-empted; a deadlock would run forever.
        num_live = sum(r.status is not RequestStatus.FINISHED for r in self.requests.values())
        for _ in range(10 * self.config.max_model_len * (num_live + 1)):
            if not self.scheduler.has_unfinished_requests() and self.held is None:
                break
            self.step(late=False)
        assert not self.scheduler.has_unfinished_requests()
        self.step(late=False)  # flushes the last removed ids
        self.block_bookkeeping()
        assert not self.executor.seqs
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.num_blocks_in_use == 0
        assert all(b.ref_count == 0 for b in pool.blocks)
        assert pool.num_free_blocks == pool.num_blocks
        kv = self.scheduler.kv_cache_manager
        assert kv.num_free_cpu_blocks + (len(kv.tier) if kv.tier else 0) == self.config.num_cpu_blocks
        for request in self.requests.values():
            assert request.status is RequestStatus.FINISHED
        stats = self.scheduler.stats
        assert stats.num_running == stats.num_waiting == stats.num_swapped == stats.gpu_blocks_in_use == 0
        assert stats.num_preemptions == sum(r.num_preemptions for r in self.requests.values())


SchedulerMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # The explain phase takes minutes on a failing state machine; shrinking alone is enough.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
TestSchedulerMachine = SchedulerMachine.TestCase


def _replay(setup: dict, steps: list[tuple[str, dict]]) -> None:
    """Runs the machine through `steps` (rule name, arguments), checking the invariants after each,
    as Hypothesis does, then its teardown: a falsifying case it once found, kept as a regression."""
    machine = SchedulerMachine()
    machine.setup(**setup)
    invariants = (
        machine.block_bookkeeping,
        machine.prompt_tokens_counted_as_executed,
        machine.request_counters,
    )
    for name, kwargs in steps:
        getattr(machine, name)(**kwargs)
        for check in invariants:
            check()
    machine.teardown()


def _add(**kwargs) -> tuple[str, dict]:
    """An add_request step for `_replay` (no output budget, priority 0, no tail unless given)."""
    return "add_request", dict(max_tokens_frac=0.0, priority=0, tail=[], template=0) | kwargs


def _step(late: bool) -> tuple[str, dict]:
    return "step", {"late": late}


def test_a_sliding_window_keeps_what_a_rejected_proposal_leaves_in_view():
    """Found by a 20,000-example run: a request swapped out (window 2, block size 1) while its one
    n-gram proposal was in flight kept only the blocks its next query would read had the proposal
    been accepted. It was rejected, the query sat one position earlier, and the block before it was
    gone: "position 3 of group 0 has no block". Windows now keep what a query reads with every
    proposal in flight rejected (`kv_cache_manager._next_position`)."""
    _replay(
        dict(
            block_size=1,
            max_model_len=6,
            extra_blocks=0,
            num_cpu_blocks=1,
            max_num_seqs=3,
            max_num_batched_tokens=5,
            enable_prefix_caching=False,
            preemption_mode="swap",
            sliding_windows=(2,),
            tier_share=0.0,
            num_disk_offload_blocks=0,
            num_speculative_tokens=1,
            max_num_loaded_blocks=0,
        ),  # fmt: skip
        [
            _step(False),
            *[_add(prefix_len=0)] * 7,
            _add(prefix_len=3),
            _step(True),
            _add(max_tokens_frac=1.0, prefix_len=3, priority=1, tail=[1]),
            _step(False),
            _step(False),
            _step(False),
            _add(prefix_len=2),
            _step(True),
            _step(False),
        ],
    )


def test_a_swapped_window_lets_go_of_what_accepted_proposals_leave_out_of_view():
    """Found by an 8,000-example run after the fix above (shrunk by hand): swapped out with a
    proposal in flight, a window kept one block more than its query would read; the proposal was
    accepted and the block stayed. Settling the proposals now also trims a swapped request's
    window from the front."""
    _replay(
        dict(
            max_num_seqs=6,
            max_model_len=16,
            max_num_batched_tokens=15,
            sliding_windows=(2,),
            block_size=1,
            num_speculative_tokens=1,
            extra_blocks=1,
            num_cpu_blocks=2,
            preemption_mode="swap",
            num_disk_offload_blocks=8,
            tier_share=1.0,
            max_num_loaded_blocks=2,
            enable_prefix_caching=True,
        ),  # fmt: skip
        [
            _add(max_tokens_frac=0.5, prefix_len=3, priority=0, tail=[0], template=1),
            _step(True),
            _add(priority=1, max_tokens_frac=0.11691662922264937, prefix_len=1, tail=[0, 0], template=0),
            _add(priority=1, prefix_len=7, tail=[1, 0, 1], template=1),
            _add(priority=1, prefix_len=14, template=0),
            _step(False),
            _add(max_tokens_frac=1.0, prefix_len=3, priority=2, tail=[0], template=0),
            _step(False),
            _add(priority=1, prefix_len=7, template=2),
            _step(False),
            _add(priority=1, prefix_len=11, tail=[0], template=2),
            _add(prefix_len=9, priority=0, tail=[0, 0], template=1),
            *[_step(late) for late in (True, True, False, False, True)],
            _add(prefix_len=14, priority=0, tail=[1, 0, 1], template=0),
            _step(False),
        ],
    )
