"""`LLM`: vLLM's offline batch API over the in-process scheduler core and executor runner.

    from pagedserve import LLM, SamplingParams
    llm = LLM(gpu_memory_utilization=0.90, enable_prefix_caching=True, max_num_seqs=256)
    for o in llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=64)):
        print(o.prompt, o.outputs[0].text)

The scheduler's `Engine` drives the executor's `ModelRunner` through `InProcessTransport` (no gRPC,
no ports), on an asyncio loop in a background thread that lives as long as the `LLM` object: the
engine, its block tables and its prefix cache carry over from one `generate` call to the next, and
`generate` works from code that already runs an event loop (a notebook). Requests go through the
validation every door runs (`pagedserve.common.validation`), then the scheduler's checks against
the model (`pagedserve.scheduler.admission`), so a request the gRPC service or the gateway would
refuse is refused here too, as a ValueError naming the field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import structlog

from pagedserve.common.logs import configure_logging
from pagedserve.common.rules import shown
from pagedserve.common.structured_outputs import StructuredOutputs
from pagedserve.common.validation import InvalidRequest, validate_request
from pagedserve.entrypoints.chat_utils import render_chat
from pagedserve.entrypoints.inprocess import InProcessTransport
from pagedserve.entrypoints.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.entrypoints.sampling_params import SamplingParams
from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.runner import ModelRunner
from pagedserve.scheduler.admission import check_prompt, sampling_options, stop_conditions
from pagedserve.scheduler.completion import FinishReason, StopConditions
from pagedserve.scheduler.engine import Engine, ExecutorInfo
from pagedserve.scheduler.request import SamplingOptions
from pagedserve.scheduler.service import load_tokenizer, next_delta
from pagedserve.scheduler.service_config import ServiceConfig
from pagedserve.scheduler.structured import RequestGrammar

T = TypeVar("T")

PromptType = str | dict[str, Any]
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
# Config fields that name endpoints of the two services: meaningless in one process.
_NOT_ENGINE_ARGS = {"model", "host", "port", "executor"}
_SEED_STRIDE = 1_000_003


def default_model() -> str:
    """The model `LLM()` serves without `model=`: the built-in one (written once, no download)."""
    from pagedserve.cli import ensure_default_model

    return str(ensure_default_model())


@dataclass(frozen=True)
class _Prompt:
    """One prompt, validated and tokenized, with what the engine needs to run it."""

    request_id: str
    text: str | None
    token_ids: list[int]
    sampling: SamplingOptions
    stop: StopConditions
    priority: int
    logprobs: bool
    grammar: RequestGrammar | None = None


class _EngineThread:
    """An asyncio loop in a daemon thread running the engine; everything that touches the runner
    (model load, CUDA graphs, steps) happens on this one thread."""

    def __init__(self, executor: ExecutorConfig, service: ServiceConfig, tokenizer: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pagedserve-llm", daemon=True)
        self.thread.start()
        self.engine: Engine | None = None
        self.task: asyncio.Task | None = None
        try:
            self.info: ExecutorInfo = self.call(self._start(executor, service, tokenizer))
        except BaseException:
            self.stop()
            raise

    async def _start(self, executor: ExecutorConfig, service: ServiceConfig, tokenizer: Any) -> ExecutorInfo:
        runner = ModelRunner.create(executor)
        transport = InProcessTransport(runner, executor.model)
        self.engine = Engine(service, tokenizer, lambda _address: transport)
        self.task = asyncio.create_task(self.engine.run())
        return await self.unless_engine_dies(self.engine.wait_until_attached())

    async def unless_engine_dies(self, work: Coroutine[Any, Any, T]) -> T:
        """Awaits `work`, but raises the engine's error if its task ends first (requests would hang)."""
        assert self.task is not None
        work_task = asyncio.ensure_future(work)
        try:
            await asyncio.wait([self.task, work_task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work_task.done():
                work_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work_task
        if not work_task.done() or work_task.cancelled():
            self.task.result()  # raises the engine's error
            raise RuntimeError("the engine stopped")
        return work_task.result()

    async def compile_grammar(self, spec: StructuredOutputs) -> RequestGrammar:
        assert self.engine is not None
        return await self.unless_engine_dies(self.engine.compile_grammar(spec))

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the engine's loop and waits for it; Ctrl-C cancels it (its requests are
        aborted and their blocks freed) before the KeyboardInterrupt goes on."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            with contextlib.suppress(concurrent.futures.CancelledError, Exception):
                future.result(timeout=10)
            raise

    def stop(self) -> None:
        """Cancels the engine and ends the thread; the runner (and its device memory) goes with it."""
        if not self.thread.is_alive():
            return

        async def cancel() -> None:
            if self.task is not None:
                self.task.cancel()
                with contextlib.suppress(BaseException):
                    await self.task

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.engine = self.task = None


class LLM:
    """A model served in this process, for batches of prompts (vLLM's `LLM`).

    Args:
        model: a Llama-family checkpoint directory (Hugging Face layout); default: the built-in model.
        dtype, device, gpu_memory_utilization, max_model_len, block_size, swap_space, enforce_eager:
            the executor's settings (`pagedserve executor --help`).
        enable_prefix_caching, preemption_mode: the scheduler's.
        max_num_seqs, max_num_batched_tokens: the batch limits of both.
        seed: with it, each request without its own `SamplingParams.seed` gets one derived from this
            seed and the request's number, so a program's sampled outputs repeat from run to run.
        tokenizer: a directory to load the tokenizer from instead of `model`'s.
        **kwargs: any other field of `ExecutorConfig` or `ServiceConfig` (e.g.
            `num_gpu_blocks_override`, `cpu_kv_cache_space`, `stream_interval`).
            `tensor_parallel_size` above 1 raises NotImplementedError: a worker dying would have to
            end the caller's process; use the service (`pagedserve serve --tensor-parallel-size`).
    Left out (None), a setting takes the default of the config it belongs to.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str | None = None,
        device: str | None = None,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        block_size: int | None = None,
        enable_prefix_caching: bool | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        swap_space: float | None = None,
        preemption_mode: str | None = None,
        enforce_eager: bool | None = None,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not structlog.is_configured():  # the services' logs, to stderr; warnings only by default
            configure_logging("llm", level=os.environ.get("PAGEDSERVE_LOG_LEVEL", "warning"))
        model = str(model) if model is not None else default_model()
        given = dict(
            dtype=dtype,
            device=device,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            swap_space=swap_space,
            preemption_mode=preemption_mode,
            enforce_eager=enforce_eager,
        )
        given = {k: v for k, v in given.items() if v is not None} | kwargs
        executor_fields = {f.name for f in fields(ExecutorConfig)} - _NOT_ENGINE_ARGS
        service_fields = {f.name for f in fields(ServiceConfig)} - _NOT_ENGINE_ARGS
        unknown = sorted(given.keys() - executor_fields - service_fields)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)}")
        self.executor_config = ExecutorConfig(
            model=model, **{k: v for k, v in given.items() if k in executor_fields}
        )
        self.service_config = ServiceConfig(
            model=model, **{k: v for k, v in given.items() if k in service_fields}
        )
        if self.executor_config.tensor_parallel_size > 1:
            raise NotImplementedError(
                f"LLM(tensor_parallel_size={self.executor_config.tensor_parallel_size}): tensor "
                "parallelism runs in the executor service only (`pagedserve serve "
                "--tensor-parallel-size N` or `pagedserve executor --tensor-parallel-size N`); the "
                "in-process LLM runs on one device (tensor_parallel_size=1)"
            )
        if seed is not None and not 0 <= seed < (1 << 63):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {seed}")
        self.seed = seed
        self.tokenizer = load_tokenizer(tokenizer or model)
        self._request_counter = itertools.count()
        self._engine = _EngineThread(self.executor_config, self.service_config, self.tokenizer)
        self._finalizer = weakref.finalize(self, self._engine.stop)

    # ---- public API ---------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Completes every prompt; returns one RequestOutput per prompt, in the order given.

        Args:
            prompts: a string, a `{"prompt_token_ids": [...]}` dict, or a list of those.
            sampling_params: one for all prompts, or one per prompt; default `SamplingParams()`.
            use_tqdm: show a progress bar.
            priority: one per prompt (vLLM's): lower runs sooner; default 0.
        Raises:
            ValueError: a prompt or setting the engine cannot serve (the message names which).
            RuntimeError: the engine failed while running them.
        """
        if isinstance(prompts, str | dict) or not isinstance(prompts, Sequence):
            prompts = [prompts]
        parsed = [self._parse_prompt(p) for p in prompts]
        return self._run(parsed, sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Completes one conversation (a list of `{"role", "content"}` messages) or a list of them,
        rendered with the tokenizer's chat template (or `chat_template`) and the generation prompt.

        Raises:
            ValueError: the tokenizer has no chat template and none was given, or it cannot render
                a conversation.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        parsed = []
        for conversation in conversations:
            text, ids = render_chat(self.tokenizer, list(conversation), chat_template)
            parsed.append((text, ids))
        return self._run(parsed, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        """Stops the engine and frees the model's memory; the object cannot generate afterwards."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------------

    @staticmethod
    def _parse_prompt(prompt: Any) -> tuple[str | None, Any]:
        """The prompt's text (for the output) and what the validation checks as its prompt: the
        text, or the token ids; any other shape is handed on as it is, to be refused there."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, str):  # not a text prompt under another name
                raise ValueError(f"prompt: prompt_token_ids must be a list of token ids, got {shown(ids)}")
            return prompt.get("prompt"), ids
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], prompt["prompt"]
        return (prompt if isinstance(prompt, str) else None), prompt

    def _prepare(
        self,
        parsed: list[tuple[str | None, Any]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        priority: list[int] | None,
    ) -> list[_Prompt]:
        """Validates everything before anything is submitted: a bad prompt fails the whole call."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            per_prompt = [params] * len(parsed)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(parsed):
                raise ValueError(
                    f"sampling_params: {len(per_prompt)} given for {len(parsed)} prompts "
                    "(give one, or one per prompt)"
                )
        if priority is not None and (not isinstance(priority, Sequence) or len(priority) != len(parsed)):
            raise ValueError(f"priority: give one per prompt ({len(parsed)}), got {shown(priority)}")
        info = self._engine.info
        prepared = []
        for i, ((text, prompt), p) in enumerate(zip(parsed, per_prompt, strict=True)):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}]: expected SamplingParams, got {type(p).__name__}")
            number = next(self._request_counter)
            values = p.request_values() | {
                "prompt": prompt,
                "priority": None if priority is None else priority[i],
            }
            if p.seed is None and self.seed is not None:
                values["seed"] = (self.seed * _SEED_STRIDE + number) % (1 << 63)
            try:
                request = validate_request(values)  # the one validation every door runs
                ids = request.prompt
                ids = list(self.tokenizer.encode(ids)) if isinstance(ids, str) else list(ids)
                check_prompt(ids, info)  # then what needs the model, as the scheduler checks it
                sampling, stop = sampling_options(request), stop_conditions(request, len(ids), info)
                grammar = None
                if request.structured_outputs is not None:  # compiled once per distinct constraint
                    grammar = self._engine.call(self._engine.compile_grammar(request.structured_outputs))
            except InvalidRequest as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
            prepared.append(
                _Prompt(
                    str(number), text, ids, sampling, stop, request.priority, p.logprobs is not None, grammar
                )
            )
        return prepared

    def _run(
        self,
        parsed: list[tuple[str | None, Any]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")
        prompts = self._prepare(parsed, params, priority)
        if not prompts:
            return []
        from tqdm import tqdm

        with tqdm(total=len(prompts), desc="Processed prompts", unit="prompt", disable=not use_tqdm) as bar:
            return self._engine.call(self._engine.unless_engine_dies(self._generate_all(prompts, bar.update)))

    async def _generate_all(
        self, prompts: list[_Prompt], on_done: Callable[[int], object]
    ) -> list[RequestOutput]:
        # At most max_queue_len requests in the engine at once: it refuses more (EngineFull).
        room = asyncio.Semaphore(self.service_config.max_queue_len)

        async def one(prompt: _Prompt) -> RequestOutput:
            async with room:
                output = await self._generate_one(prompt)
            on_done(1)
            return output

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def _generate_one(self, prompt: _Prompt) -> RequestOutput:
        engine = self._engine.engine
        assert engine is not None
        request_id = prompt.request_id
        active = engine.submit(
            request_id, prompt.token_ids, prompt.sampling, prompt.stop, prompt.priority, prompt.grammar
        )
        token_ids: list[int] = []
        text: list[str] = []
        logprobs: list[float] = []
        try:
            while True:
                delta = await next_delta(active.deltas)  # raises EngineUnavailable if it fails
                token_ids += delta.token_ids
                text.append(delta.text)
                logprobs += delta.logprobs
                if delta.finish_reason is not None:
                    break
        except Exception as exc:
            raise RuntimeError(f"request {request_id} failed: {exc}") from exc
        finally:
            engine.abort(active)  # a no-op once finished; frees the blocks of a cancelled call
        completion = CompletionOutput(
            index=0,
            text="".join(text),
            token_ids=token_ids,
            finish_reason=_FINISH_REASONS[FinishReason(delta.finish_reason)],
        )
        if prompt.logprobs:
            completion.logprobs = [
                {t: Logprob(lp, decoded_token=self.tokenizer.decode([t]))}
                for t, lp in zip(token_ids, logprobs, strict=True)
            ]
            completion.cumulative_logprob = sum(logprobs)
        return RequestOutput(
            request_id=request_id,
            prompt=prompt.text,
            prompt_token_ids=prompt.token_ids,
            outputs=[completion],
            finished=True,
            num_cached_tokens=active.request.num_cached_prompt_tokens,
        )
