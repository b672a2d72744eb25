"""CPU benchmark of the scheduler's per-step hot path, with an executor that answers instantly.

A fake `ExecutorTransport` answers every plan at once with one token per sampling request (tokens
of real text, never EOS), so the step rate is bounded only by this process: scheduling, the plan's
and output's (de)serialization, `process_output`, each request's `Completion.add_token`
(detokenization, stop checks) and the streaming of each delta to its client.

    python -m benchmarks.hotpath                 # deltas drained through GenerationService._stream
    python -m benchmarks.hotpath --grpc          # real public gRPC service, clients in a subprocess
    python -m benchmarks.hotpath --profile       # cProfile of the scheduler process
    python -m benchmarks.hotpath --model /tmp/llama-8b-shape --workload W1-JSON   # structured outputs
    python -m benchmarks.hotpath --num-requests 1 --input-len 512:512 --output-len 2000 \
        --speculative-config '{"method": "draft_model", "model": "draft", "num_speculative_tokens": 6}'

`--workload W1` or `W1-JSON` takes that preset's requests and lengths and the throughput flags
(512 requests, --max-num-seqs 512, --stream-interval 4); W1-JSON puts its JSON schema on every
request, so the scheduler keeps one xgrammar matcher per request and sends their masks behind each
plan (late masks) as to a real executor, which here samples within them (`_masked_token`). Give a
model with the real vocabulary (`pagedserve make-model --shape llama-8b --no-weights DIR`): the
masks are as wide as it.

With `--speculative-config` the fake executor verifies proposals as a real one does: a draft
model's (it proposes them: the text's next tokens, every third one wrong) or n-gram's (accepted
while they are the text's next tokens), and answers with the accepted run and one more token. At
one request this is a speculating request's round trip, the scheduler's share of every step.

"CPU/step" is this process's CPU time per step (all threads, gRPC's included), less the fake
executor's own time; at the executor's 16 ms per decode step of batch 256 on an H200, anything near
that makes the scheduler the bottleneck. The digest covers every token and every byte of text the
clients received, so runs before and after a change can be checked for identical output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import hashlib
import io
import json
import logging
import pstats
import random
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import structlog

from pagedserve.bench.workloads import PRESETS
from pagedserve.common.speculative import SpeculativeConfig, parse_flag
from pagedserve.common.validation import validate_request, values_from_proto
from pagedserve.protos import executor_pb2, generation_pb2, generation_pb2_grpc
from pagedserve.scheduler.admission import sampling_options, stop_conditions
from pagedserve.scheduler.engine import Engine
from pagedserve.scheduler.service import GenerationService, load_tokenizer, public_server
from pagedserve.scheduler.service_config import ServiceConfig
from pagedserve.scheduler.transport import StepStream

BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
WORKLOADS = ("W1", "W1-JSON")
W1_THROUGHPUT_FLAGS = dict(max_num_seqs=512, stream_interval=4)  # scripts/gpu-bench.sh's W1 flags


class FakeExecutor:
    """Tracks each sequence's token count as the executor does and samples when a plan computes its
    last known token; the sampled ids walk through `text_ids` from a per-sequence offset."""

    def __init__(
        self,
        text_ids: list[int],
        vocab_size: int,
        eos_token_ids: list[int],
        step_seconds: float = 0.0,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.text_ids = text_ids
        self.speculative = speculative
        self.step_seconds = step_seconds  # simulated device time per step, steps run one after another
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.seconds = 0.0  # time spent here (not the scheduler's), subtracted from the CPU figures

    def __str__(self) -> str:
        return "fake executor"

    async def attach(self, scheduler_id: str, timeout: float | None) -> executor_pb2.AttachResponse:
        spec = self.speculative
        draft = spec is not None and spec.method == "draft_model"
        return executor_pb2.AttachResponse(
            draft_model=spec.model if draft else "",
            num_speculative_tokens=spec.num_speculative_tokens if draft else 0,
            lease_epoch=1,
            model="bench",
            max_model_len=MAX_MODEL_LEN,
            vocab_size=self.vocab_size,
            block_size=BLOCK_SIZE,
            num_gpu_blocks=1 << 16,
            num_cpu_blocks=0,
            eos_token_ids=self.eos_token_ids,
            device="none",
            accepts_late_masks=True,
            accepts_shared_mask_rows=True,
        )

    def open_steps(self, lease_epoch: int) -> StepStream:
        return _FakeSteps(self)

    async def heartbeat(self, lease_epoch: int, timeout: float) -> None:
        pass

    async def detach(self, lease_epoch: int, timeout: float) -> None:
        pass

    async def close(self) -> None:
        pass


class _FakeSteps:
    def __init__(self, executor: FakeExecutor) -> None:
        self._executor = executor
        self._seqs: dict[int, list[int]] = {}
        self._outputs: deque[tuple[float, bytes]] = deque()  # (ready at, serialized output)
        self._device_free_at = 0.0
        # A plan whose late masks are still to come: (step id, seq ids, tokens, their states).
        self._awaiting: tuple[int, list[int], list[int], list[list[int]]] | None = None

    async def write(self, plan: executor_pb2.StepPlan) -> None:
        data = plan.SerializeToString()  # what grpc does with it in this process
        start = time.perf_counter()
        plan = executor_pb2.StepPlan.FromString(data)  # the executor's side
        if plan.HasField("masks"):  # the late masks of the step awaiting them: it samples now
            assert self._awaiting is not None and self._awaiting[0] == plan.masks.step_id
            step_id, seq_ids, token_ids, states = self._awaiting
            self._awaiting = None
            masks = plan.masks
            self._apply_masks(seq_ids, token_ids, states, masks.seq_ids, masks.token_bitmask, masks.rows)
            self._emit(step_id, seq_ids, token_ids, start)
            return
        assert self._awaiting is None, "a plan while the one before awaits its masks"
        text_ids, n = self._executor.text_ids, len(self._executor.text_ids)
        seqs = self._seqs
        for seq_id in plan.removed_seq_ids:
            seqs.pop(seq_id, None)
        seq_ids, token_ids, states = [], [], []
        counts: list[int] = []  # tokens per sampling request (speculative decoding)

        def step(seq_id: int, state: list[int], num_new: int, proposals: list[int] | None = None) -> None:
            # state: tokens known, tokens computed, tokens sampled, offset into text_ids
            state[1] += num_new
            num_draft = 0 if proposals is None else len(proposals)
            if state[1] - num_draft != state[0]:
                return
            run = [text_ids[(state[3] + state[2]) % n]]
            for proposal in proposals or ():  # accepted while it is the text's next token
                if proposal != run[-1]:
                    break
                run.append(text_ids[(state[3] + state[2] + len(run)) % n])
            state[1] -= num_draft - (len(run) - 1)
            seq_ids.append(seq_id)
            token_ids.extend(run)
            counts.append(len(run))
            states.append(state)
            state[0] += len(run)
            state[2] += len(run)

        for r in plan.new_requests:
            # The sampled ids depend on the prompt, not on the seq id (arrival order varies).
            state = [len(r.token_ids), r.num_computed_tokens, len(r.token_ids) - r.num_prompt_tokens]
            state.append(r.token_ids[0] * 997 + r.num_prompt_tokens * 31)
            seqs[r.seq_id] = state
            step(r.seq_id, state, r.num_new_tokens)
        for r in plan.running:
            state = seqs[r.seq_id]
            proposals = list(r.draft_token_ids)
            if r.num_draft_tokens and not proposals:  # the draft model's: the text, every third wrong
                at = state[3] + state[2]
                proposals = [
                    text_ids[(at + j) % n] if (at + j) % 3 != 2 else -1 for j in range(r.num_draft_tokens)
                ]
            step(r.seq_id, state, r.num_new_tokens, proposals if r.num_draft_tokens else None)
        if plan.masked_seq_ids:
            assert not any(c > 1 for c in counts), "hotpath: no masks with speculation"
            self._apply_masks(
                seq_ids, token_ids, states, plan.masked_seq_ids, plan.token_bitmask, plan.mask_rows
            )
        if plan.late_masked_seq_ids:  # it samples once its StepMasks arrives
            self._awaiting = (plan.step_id, seq_ids, token_ids, states)
            self._executor.seconds += time.perf_counter() - start
            return
        self._emit(plan.step_id, seq_ids, token_ids, start, counts if any(c > 1 for c in counts) else ())

    def _apply_masks(self, seq_ids, token_ids, states, masked_seq_ids, packed: bytes, rows) -> None:
        """Structured outputs: each masked row's token made one its mask allows (`_masked_token`);
        `rows`: shared rows, each masked request's (StepPlan.mask_rows; empty: one row each)."""
        masks = np.frombuffer(packed, dtype="<i4").reshape(-1, (self._executor.vocab_size + 31) // 32)
        row_of = dict(zip(masked_seq_ids, rows or range(len(masked_seq_ids)), strict=True))
        for i, seq_id in enumerate(seq_ids):
            row = row_of.get(seq_id)
            if row is not None:
                token_ids[i] = _masked_token(masks[row], token_ids[i], states[i])

    def _emit(
        self, step_id: int, seq_ids: list[int], token_ids: list[int], start: float, counts: Sequence[int] = ()
    ) -> None:
        output = executor_pb2.StepOutput(
            step_id=step_id, seq_ids=seq_ids, token_ids=token_ids, num_tokens=counts,
            logprobs=[0.0] * len(token_ids),
        )  # fmt: skip
        self._device_free_at = max(start, self._device_free_at) + self._executor.step_seconds
        self._outputs.append((self._device_free_at, output.SerializeToString()))
        self._executor.seconds += time.perf_counter() - start

    async def read(self) -> executor_pb2.StepOutput | None:
        if not self._outputs:
            return None
        ready_at, data = self._outputs.popleft()
        # A gRPC read yields to the clients' tasks at least once, and for as long as the device works.
        await asyncio.sleep(max(0.0, ready_at - time.perf_counter()))
        return executor_pb2.StepOutput.FromString(data)  # grpc parses it here

    def cancel(self) -> None:
        self._outputs.clear()

    def ended(self) -> bool:
        return False


def _masked_token(mask: np.ndarray, token_id: int, state: list[int]) -> int:
    """The token a constrained row samples: the text's next token where its mask allows it (free
    text inside a JSON string), else one of the allowed tokens picked by the sequence's state."""
    if (int(mask[token_id >> 5]) >> (token_id & 31)) & 1:
        return token_id
    words = np.flatnonzero(mask)  # only those unpacked: a few of 4,008 under the tiny tokenizer
    bits = np.unpackbits(mask[words].view(np.uint8), bitorder="little").reshape(len(words), 32)
    rows, cols = np.nonzero(bits)
    allowed = words[rows] * 32 + cols  # in token order, as np.flatnonzero over every bit
    return int(allowed[(state[3] + 7919 * state[2]) % len(allowed)])


class TimedEngine(Engine):
    """Places the requests once every one is queued (clients over gRPC arrive one by one), so that
    stepping starts then, and records wall and CPU time from then to the last token."""

    expected_requests = expected_tokens = 0
    start_wall = start_cpu = end_wall = end_cpu = 0.0

    async def run(self) -> None:
        self._held: list = []
        gc.collect()  # as the scheduler service does at startup (scheduler/service.py)
        gc.freeze()
        await super().run()

    def _place(self, active) -> None:
        if self.start_wall:
            return super()._place(active)
        self._held.append(active)
        if len(self._held) == self.expected_requests:
            self.start_wall, self.start_cpu = time.perf_counter(), time.process_time()
            for held in self._held:
                super()._place(held)
            self._held.clear()

    def on_output(self, replica, plan, output):
        deliver = super().on_output(replica, plan, output)

        def deliver_and_time() -> None:
            deliver()
            if not self.end_wall and self.tokens_generated >= self.expected_tokens:
                self.end_wall, self.end_cpu = time.perf_counter(), time.process_time()

        return deliver_and_time


def prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.input_len.split(":"))
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(args.num_requests)
    ]


def output_lengths(args: argparse.Namespace) -> list[int]:
    """Each request's max_tokens: `--output-len N`, or LO:HI drawn per request (requests then
    finish one after another over the run, as in W1, and their endings are part of the cost)."""
    lo, _, hi = args.output_len.partition(":")
    rng = random.Random(args.seed + 1)
    return [rng.randint(int(lo), int(hi or lo)) for _ in range(args.num_requests)]


def generate_request(
    i: int, prompt: list[int], output_len: int, schema: dict | None = None
) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        request_id=f"bench-{i}",
        token_ids=generation_pb2.TokenIds(ids=prompt),
        stopping=generation_pb2.StoppingCriteria(max_tokens=output_len, ignore_eos=True),
    )
    if schema is not None:
        request.structured_output.json_schema = json.dumps(schema)
    return request


class Digest:
    """Hash of everything each client received, in request order."""

    def __init__(self, n: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.messages = 0

    def add(self, i: int, token_ids, text: str) -> None:
        self.messages += 1
        self.tokens[i].extend(token_ids)
        self.texts[i].append(text)

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for tokens, texts in zip(self.tokens, self.texts, strict=True):
            h.update(repr(tokens).encode())
            h.update("".join(texts).encode())
        return h.hexdigest()[:12]


async def drain_in_process(service: GenerationService, args, requests) -> Digest:
    """Each client as the service serves it (merge, GenerateResponse), minus the gRPC send."""
    engine = service.engine
    info = await engine.wait_until_attached()
    digest = Digest(len(requests))

    async def client(i: int, request: generation_pb2.GenerateRequest) -> None:
        prompt = list(request.token_ids.ids)
        params = validate_request(values_from_proto(request))
        grammar = None
        if params.structured_outputs is not None:  # compiled once, before the timing starts
            grammar = await engine.compile_grammar(params.structured_outputs)
        stop = stop_conditions(params, len(prompt), info)
        active = engine.submit(request.request_id, prompt, sampling_options(params), stop, grammar=grammar)
        async for response in service._stream(active):
            digest.add(i, response.token_ids, response.text)

    await asyncio.gather(*(client(i, r) for i, r in enumerate(requests)))
    return digest


async def drain_over_grpc(service: GenerationService, args, requests) -> Digest:
    """The real public service on loopback; the clients run in a subprocess (not measured here)."""
    server = public_server(service)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await service.engine.wait_until_attached()
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        client_argv = [sys.executable, "-m", "benchmarks.hotpath", "--client", f"127.0.0.1:{port}"]
        client_argv += ["--client-out", out.name, *sys.argv[1:]]
        proc = await asyncio.create_subprocess_exec(*client_argv)
        try:
            rc = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
        await server.stop(grace=1.0)
        if rc != 0:
            raise RuntimeError(f"the client process failed ({rc})")
        digest = Digest(len(requests))
        lines = Path(out.name).read_text().splitlines()
        for i, line in enumerate(lines[1:]):
            tokens, _, text = line.partition("\t")
            digest.add(i, [int(t) for t in tokens.split(",")], bytes.fromhex(text).decode())
        digest.messages = int(lines[0])
        return digest


async def run_clients(address: str, out: str, requests) -> None:
    """The --grpc clients (in their own process): every request at once, one stream each."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tokens: list[list[int]] = [[] for _ in requests]
        texts: list[list[str]] = [[] for _ in requests]
        messages = 0

        async def client(i: int, request) -> None:
            nonlocal messages
            async for response in stub.Generate(request):
                messages += 1
                tokens[i].extend(response.token_ids)
                texts[i].append(response.text)

        await asyncio.gather(*(client(i, r) for i, r in enumerate(requests)))
    lines = [str(messages)]
    lines += [
        ",".join(map(str, t)) + "\t" + "".join(x).encode().hex() for t, x in zip(tokens, texts, strict=True)
    ]
    Path(out).write_text("\n".join(lines) + "\n")


async def bench(args, tokenizer, requests, text_ids) -> tuple[TimedEngine, FakeExecutor, Digest]:
    # The model's logits width, as a real executor reports it (the masks are as wide as it).
    vocab_size = max(len(tokenizer), json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    spec = parse_flag(args.speculative_config)
    executor = FakeExecutor(text_ids, vocab_size, [tokenizer.eos_token_id], args.step_ms / 1000, spec)
    config = ServiceConfig(
        model=args.model,
        speculative_config=spec,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        stream_interval=args.stream_interval,
        max_model_len=MAX_MODEL_LEN,
    )
    engine = TimedEngine(config, tokenizer, lambda _address: executor)
    engine.expected_requests = len(requests)
    engine.expected_tokens = sum(r.stopping.max_tokens for r in requests)
    service = GenerationService(engine)
    engine_task = asyncio.create_task(engine.run())
    try:
        drain = drain_over_grpc if args.grpc else drain_in_process
        digest = await drain(service, args, requests)
    finally:
        engine_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await engine_task
    return engine, executor, digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hotpath", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help="model directory (default: the tiny model, in a temp dir)"
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="a preset's requests and lengths with the throughput flags (W1-JSON: its schema on each)",
    )
    parser.add_argument("--num-requests", type=int, help="default 256 (a workload's own)")
    parser.add_argument("--input-len", help="prompt lengths, LO:HI tokens (default 128:1024)")
    parser.add_argument("--output-len", help="max_tokens: N, or LO:HI per request (default 200)")
    parser.add_argument("--max-num-seqs", type=int, help="default 256 (a workload's: 512)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-ms", type=float, default=0.0, help="simulated device time per step")
    parser.add_argument("--stream-interval", type=int, help="tokens per streamed message (default 1)")
    parser.add_argument("--grpc", action="store_true", help="stream through the public gRPC service")
    parser.add_argument("--speculative-config", help="speculative decoding, as the scheduler's flag")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the scheduler process")
    parser.add_argument("--profile-lines", type=int, default=30)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--client-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = dict(
        num_requests=256, input_len="128:1024", output_len="200", max_num_seqs=256, stream_interval=1
    )
    if args.workload:
        preset = PRESETS[args.workload]
        defaults.update(
            num_requests=preset["num_prompts"],
            input_len=preset["input_len"],
            output_len=preset["output_len"],
            **W1_THROUGHPUT_FLAGS,
        )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    schema = PRESETS[args.workload].get("structured_outputs", {}).get("json") if args.workload else None

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with contextlib.ExitStack() as stack:
        if args.model is None:
            from pagedserve.tiny_model import write_tiny_model

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-hotpath-"))
            args.model = str(write_tiny_model(tmp))
        tokenizer = load_tokenizer(args.model)
        lengths = output_lengths(args)
        requests = [
            generate_request(i, p, n, schema)
            for i, (p, n) in enumerate(zip(prompts(args, len(tokenizer)), lengths, strict=True))
        ]
        if args.client:
            asyncio.run(run_clients(args.client, args.client_out, requests))
            return 0
        from pagedserve.tiny_model import CORPUS

        text_ids = tokenizer.encode(CORPUS, add_special_tokens=False)
        profiler = cProfile.Profile() if args.profile else None
        if profiler:
            profiler.enable()
        engine, executor, digest = asyncio.run(bench(args, tokenizer, requests, text_ids))
        if profiler:
            profiler.disable()

    wall = engine.end_wall - engine.start_wall
    cpu = engine.end_cpu - engine.start_cpu - executor.seconds
    mode = "gRPC public service" if args.grpc else "in-process streams"
    print(
        f"{args.workload or 'custom'}: {args.num_requests} requests x {args.output_len} tokens, prompts "
        f"{args.input_len}, --max-num-seqs {args.max_num_seqs}, --stream-interval {args.stream_interval}, "
        f"{mode}, device {args.step_ms:g} ms/step"
    )
    header = ("steps", 7), ("wall s", 8), ("steps/s", 9), ("tok/s", 9), ("CPU ms/step", 12), ("msgs", 7)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'digest':>13}")
    print(
        f"{engine.steps:>7} {wall:>8.2f} {engine.steps / wall:>9.1f} {engine.tokens_generated / wall:>9.0f}"
        f" {1000 * cpu / engine.steps:>12.2f} {digest.messages:>7} {digest.hexdigest():>13}"
    )
    if profiler:
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream).strip_dirs().sort_stats("tottime")
        stats.print_stats(args.profile_lines)
        print(stream.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
