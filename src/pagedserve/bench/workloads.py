"""Benchmark workloads: request lengths, token-id prompts and arrival times (W1, W2, W3 of
the README's Workloads section are presets of these: W4 compares routing over several executors,
W5 is the KV-bound workload of the FP8 KV cache, W1-JSON is W1 with a JSON schema on every request,
the cost of structured outputs, W6 is multi-turn chat, whose histories come back as prompts: the
prefix cache's CPU tier, W7 is real text whose answers repeat their prompts: speculative decoding)."""

from __future__ import annotations

import functools
import math
import random
import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LengthRange:
    """A token count: fixed (lo == hi) or uniform over [lo, hi] inclusive."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo <= self.hi:
            raise ValueError(f"bad length range {self.lo}:{self.hi}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """N or MIN:MAX; anything else ("1:", "1:2:3", "abc") is a ValueError, not a guess."""
        lo, sep, hi = text.partition(":")
        return cls(int(lo), int(hi) if sep else int(lo))

    def sample(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True)
class Workload:
    """What to send; `input_len` is the unique suffix when `prefix_len` > 0 (shared-prefix).

    With `num_prefixes` > 1 there are that many distinct shared prefixes, and request i uses
    prefix i mod num_prefixes: the groups arrive interleaved (prefix 0, 1, ..., then 0 again), so
    a router that ignores the prefix cache spreads every group over every executor.

    "source-edit" (W7): each prompt is a Python standard-library file cut to `input_len`
    tokens of `tokenizer` (a model directory), then a line asking to repeat one of the functions it
    defines with one change: text whose answer largely repeats the prompt, as "rewrite this
    function" requests do, so that n-gram and draft-model speculation meet real text.

    "multi-turn": `num_prompts` conversations of `num_turns` turns each; a turn adds `input_len`
    user tokens to the conversation's history (every earlier prompt and answer) and is sent
    `think_time` seconds after the previous turn's answer ended, so each prompt is the whole
    conversation so far.
    """

    dataset: str  # one of DATASETS
    num_prompts: int
    input_len: LengthRange
    output_len: LengthRange
    prefix_len: int = 0
    seed: int = 1
    num_prefixes: int = 1
    structured_outputs: dict | None = None  # a constraint on every request (W1-JSON)
    num_turns: int = 1  # multi-turn: turns per conversation
    think_time: float = 0.0  # multi-turn: seconds between an answer and the next turn
    tokenizer: str | None = None  # source-edit: the model directory whose tokenizer cuts the files

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}")
        if self.num_turns < 1 or not 0 <= self.think_time < math.inf:
            raise ValueError("num_turns must be positive and think_time a finite >= 0")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be positive")
        if self.output_len.lo < 1:
            raise ValueError("output lengths must be at least 1")
        if self.num_prefixes < 1:
            raise ValueError("num_prefixes must be positive")
        if self.dataset == "source-edit" and not self.tokenizer:
            raise ValueError("the source-edit dataset (W7) needs a tokenizer: a model directory")


# W1-JSON: an object of 4 typed fields, the last a free text of at least 4,096 characters, so that
# (as in W1, with ignore_eos) every output runs to its max_tokens of 64 to 512 and only the
# constraint differs: an integer and a number with bounds, an enum, then the text.
W1_JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "label": {"enum": ["alpha", "beta", "gamma", "delta"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "summary": {"type": "string", "minLength": 4096},
    },
    "required": ["id", "label", "score", "summary"],
    "additionalProperties": False,
}

DATASETS = ("random", "shared-prefix", "multi-turn", "source-edit")

# the README's Workloads; W3 is W1's lengths with Poisson arrivals (the rate comes from the command line).
PRESETS: dict[str, dict] = {
    "W1": dict(
        dataset="random", num_prompts=512, input_len="128:1024", output_len="64:512", request_rate="inf"
    ),
    "W2": dict(
        dataset="shared-prefix",
        num_prompts=256,
        prefix_len=1024,
        input_len="64",
        output_len="64",
        request_rate="inf",
    ),
    "W3": dict(dataset="random", num_prompts=512, input_len="128:1024", output_len="64:512"),
    # Issue 13: 8 shared 1,024-token prefixes x 64 requests, interleaved, to compare exact prefix
    # routing with round robin over several executors (prefill tokens computed, output tok/s).
    "W4": dict(
        dataset="shared-prefix",
        num_prompts=512,
        num_prefixes=8,
        prefix_len=1024,
        input_len="64",
        output_len="64",
        request_rate="inf",
    ),
    # KV-bound: every request at once, far more KV than a bf16 pool holds on one H200 (the FP8
    # KV cache comparison; needs --max-model-len >= 12512 on the executor).
    "W5": dict(dataset="random", num_prompts=128, input_len="12000", output_len="512", request_rate="inf"),
    # Issue 31: W1 with W1_JSON_SCHEMA on every request (structured outputs' cost against W1).
    "W1-JSON": dict(
        dataset="random",
        num_prompts=512,
        input_len="128:1024",
        output_len="64:512",
        request_rate="inf",
        structured_outputs={"json": W1_JSON_SCHEMA},
    ),
    # Issue 29: multi-turn chat, 64 conversations x 6 turns of 256 user tokens and 128 output tokens,
    # 0.5 s of think time: histories of up to 2,304 tokens come back as prompts (the CPU tier; run
    # with a GPU pool of about a quarter of the histories: --num-gpu-blocks-override).
    "W6": dict(
        dataset="multi-turn",
        num_prompts=64,
        num_turns=6,
        input_len="256",
        output_len="128",
        think_time=0.5,
        request_rate="inf",
    ),
    # Issue 30: speculation on real text (the built-in model; run at --max-concurrency 1,4,16),
    # greedy, every answer 256 tokens.
    "W7": dict(
        dataset="source-edit", num_prompts=32, input_len="512:1024", output_len="256", request_rate="inf"
    ),
}
DEFAULTS = dict(
    dataset="random",
    num_prompts=100,
    input_len="128",
    output_len="128",
    prefix_len=0,
    num_prefixes=1,
    request_rate="inf",
    num_turns=1,
    think_time=0.0,
)


@dataclass(frozen=True)
class BenchRequest:
    """One request. A multi-turn request (turn > 0) carries only its turn's new tokens in `prompt`:
    the sender prepends the conversation so far once the previous turn's answer is in, after
    `think_time` seconds."""

    index: int
    prompt: tuple[int, ...]
    output_len: int
    structured_outputs: dict | None = None
    conversation: int | None = None
    turn: int = 0
    think_time: float = 0.0


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """W1's [1000, 100000), clamped so a small test vocabulary still works."""
    if vocab_size >= 100_000:
        return 1000, 100_000
    return min(1000, vocab_size // 2), vocab_size


def generate_requests(
    workload: Workload, vocab_size: int, max_model_len: int | None = None
) -> list[BenchRequest]:
    """Draws every request from `random.Random(seed)`: for each, the prompt (its length, then its
    ids), then the output length; the shared prefixes, if any, are drawn first, one after another.
    Request i gets prefix i mod num_prefixes. Lengths are capped to `max_model_len` afterwards,
    so the draws do not depend on the server."""
    rng = random.Random(workload.seed)
    lo, hi = token_id_range(vocab_size)
    if workload.dataset == "source-edit":
        return source_edit_requests(workload, rng, max_model_len)
    if workload.dataset == "multi-turn":  # conversation c's turn t is request c * num_turns + t
        turns = workload.num_turns
        return [
            BenchRequest(
                c * turns + t,
                tuple(rng.randrange(lo, hi) for _ in range(workload.input_len.sample(rng))),
                workload.output_len.sample(rng),
                workload.structured_outputs,
                conversation=c,
                turn=t,
                think_time=workload.think_time,
            )
            for c in range(workload.num_prompts)
            for t in range(turns)
        ]
    num_prefixes = workload.num_prefixes if workload.prefix_len else 1
    prefixes = [[rng.randrange(lo, hi) for _ in range(workload.prefix_len)] for _ in range(num_prefixes)]
    requests = []
    for index in range(workload.num_prompts):
        n = workload.input_len.sample(rng)
        prompt = prefixes[index % num_prefixes] + [rng.randrange(lo, hi) for _ in range(n)]
        output_len = workload.output_len.sample(rng)
        if max_model_len is not None:
            prompt = prompt[: max_model_len - 1]
            output_len = max(1, min(output_len, max_model_len - len(prompt)))
        requests.append(BenchRequest(index, tuple(prompt), output_len, workload.structured_outputs))
    return requests


_FUNCTION = re.compile(r"^[ \t]*def ([A-Za-z_]\w*)\(", re.MULTILINE)


@functools.lru_cache(maxsize=1)
def _standard_library_files() -> tuple:
    """The Python files of this machine's standard library, in the corpus' sorted order."""
    from pagedserve.bench.corpus import corpus_roots, list_files

    return tuple(f for f in list_files(corpus_roots(())[0]) if f.path.suffix == ".py")


@functools.lru_cache(maxsize=2)
def _tokenizer(directory: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def source_edit_requests(
    workload: Workload, rng: random.Random, max_model_len: int | None
) -> list[BenchRequest]:
    """W7's requests (see `Workload`): standard-library files in a seeded order, each used once,
    skipping those shorter than the shortest prompt or defining no function; per request its
    first `input_len` tokens, one function defined in them, and the instruction."""
    tokenizer = _tokenizer(workload.tokenizer)
    files = list(_standard_library_files())
    rng.shuffle(files)
    requests = []
    for file in files:
        if len(requests) == workload.num_prompts:
            break
        try:
            text = file.path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        n = workload.input_len.sample(rng)
        output_len = workload.output_len.sample(rng)
        if max_model_len is not None:
            n = max(16, min(n, max_model_len - output_len - 48))
        ids = tokenizer.encode(text, add_special_tokens=False)
        body = tokenizer.decode(ids[:n])
        names = _FUNCTION.findall(body)
        if len(ids) < workload.input_len.lo or not names:
            continue
        name = rng.choice(names)
        ask = f"\n\n# Repeat the function `{name}` from above with one change: rename it to `{name}_v2`.\n"
        prompt = tokenizer.encode(body + ask)
        if max_model_len is not None:
            prompt = prompt[: max_model_len - 1]
            output_len = max(1, min(output_len, max_model_len - len(prompt)))
        requests.append(BenchRequest(len(requests), tuple(prompt), output_len, workload.structured_outputs))
    if len(requests) < workload.num_prompts:
        raise ValueError(
            f"only {len(requests)} standard-library files suit W7 prompts, not {workload.num_prompts}"
        )
    return requests


@dataclass(frozen=True)
class PlannedPass:
    """One measured pass: its label, request rate, and the prompts' seed and requests."""

    label: str
    request_rate: float
    seed: int
    requests: list[BenchRequest]


def plan_passes(
    workload: Workload, rates: list[float], vocab_size: int, max_model_len: int | None, tag: str = ""
) -> list[PlannedPass]:
    """One pass per rate. Pass k draws its prompts with seed + k: the first pass sends exactly the
    workload, and later passes of a sweep do not find their prompts in the prefix cache."""
    passes = []
    for k, rate in enumerate(rates):
        parts = [tag] if tag else []
        if len(rates) > 1 or not tag:
            parts.append("rate inf" if math.isinf(rate) else f"rate {rate:g}")
        seed = workload.seed + k
        requests = generate_requests(replace(workload, seed=seed), vocab_size, max_model_len)
        passes.append(PlannedPass(", ".join(parts), rate, seed, requests))
    return passes


def arrival_times(num: int, request_rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: all 0 for rate inf, else a Poisson process (the first at 0).

    The gaps come from their own seeded RNG, so W3 sends exactly W1's prompts."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(f"{seed}:arrivals")
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times
