"""Generation handlers: `/v1/chat/completions` and `/v1/completions`.

    (middlewares: request id, trace, body limit, auth)
    -> estimate prompt tokens from the body size -> admission.enter()   429/503 here, before
       the body is parsed or tokenized
    -> read + parse body -> check model -> admission.reestimate() (a stored conversation's
       prompt) -> admission.place() (prompt_cache_key's engine)
    -> admission.acquire() (queue deadline)
    -> engine Generate (deadline, request id, traceparent) -> JSON body | SSE stream -> release
    -> request metrics (GenAI conventions: duration, TTFT, time per output token, token usage)

The server runs with handler_cancellation, so a client that leaves cancels the handler: a queued
request gives up its place, a running one cancels its gRPC call (GenerateCall's exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from services.common.genai_metrics import GenAIMetrics
from services.common.pb.strata.v1 import engine_pb2
from services.common.tool_calls import CHANNELED
from services.gateway import sse
from services.gateway.admission import Rejected, Ticket, estimate_prompt_tokens
from services.gateway.background import MARK_TTL_S, STOPPED, BackgroundRun
from services.gateway.engine_client import (
    Delta,
    Echo,
    Finished,
    GenerateCall,
    Started,
    TokenLogprob,
)
from services.gateway.engines import served_models, tokenizer_call
from services.gateway.errors import (
    EngineAborted,
    EngineError,
    InvalidRequest,
    ModelNotFound,
    http_error,
)
from services.gateway.harmony import HarmonyParser
from services.gateway.middleware import log_failure
from services.gateway.response_routes import as_prompted, owner, replay
from services.gateway.responses import ChatRenderer, CompletionRenderer, Figures, usage
from services.gateway.responses_api import (
    ResponseBuilder,
    ResponsesInput,
    engine_param,
    parse_responses,
    response_usage,
    stored_record,
    summary_request,
)
from services.gateway.schemas import GenerateInput, parse_chat, parse_completion
from services.gateway.state import (
    ADMISSION,
    BACKGROUND,
    CLOCK,
    CONFIG,
    METRICS,
    POOL,
    RESPONSE_STORE,
    TRACE,
    request_id,
)
from services.gateway.tools import ToolCallParser

log = logging.getLogger("strata.gateway")

@dataclass(frozen=True)
class _Endpoint:
    """What differs between the generation endpoints: the body's parser (a coroutine: the
    Responses API reads the conversation it continues from the store), the renderer of its
    bodies, and the reply."""

    operation: str
    parse: Callable[[web.Request, Any], Awaitable[GenerateInput]]
    renderer: Callable[[str, GenerateInput], Any]
    reply: Callable[[list[_Run]], Awaitable[web.StreamResponse]]
    # a field the engine names in its chat terms, as this endpoint's request writes it
    engine_param: Callable[[str], str] = str


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, _CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, _COMPLETIONS)


async def responses(request: web.Request) -> web.StreamResponse:
    return await _generate(request, _RESPONSES)


@dataclass
class _Outcome:
    """What the request metrics need, filled in as the request goes; recorded once at its end."""

    operation: str
    clock: Callable[[], float]
    arrived_at: float
    model: str = ""  # unknown until the body is parsed
    first_token_at: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    error_type: str | None = None
    detached: bool = False  # a background response: its run records this, not the handler

    def fail(self, exc: BaseException) -> None:
        self.error_type = self.error_type or _error_type(exc)

    def record(self, metrics: GenAIMetrics) -> None:
        ttft_s = (self.first_token_at - self.arrived_at if self.first_token_at is not None
                  else None)
        metrics.record_request(self.model, self.clock() - self.arrived_at,
                               time_to_first_token_s=ttft_s, input_tokens=self.input_tokens,
                               output_tokens=self.output_tokens, error_type=self.error_type,
                               operation=self.operation)


def _error_type(exc: BaseException) -> str:
    """A low-cardinality error.type: the drop reason, the gRPC code, or the exception's class."""
    if isinstance(exc, Rejected):
        return exc.reason
    if isinstance(exc, EngineError):
        return exc.code
    if isinstance(exc, asyncio.CancelledError | ConnectionResetError):
        return "client_disconnected"
    return type(exc).__name__


@dataclass
class _Run:
    """What one generation needs while it answers."""

    request: web.Request
    spec: GenerateInput
    renderer: Any  # the endpoint's: a Renderer, or the Responses API's ResponseBuilder
    call: GenerateCall
    started: Started
    arrived_at: float
    queue_wait_s: float
    outcome: _Outcome
    first_token_at: float | None = None
    num_deltas: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # a chat request with tools: its calls, parsed out; with a channeled (harmony) model, every
    # chat answer: its reasoning and calls split from the answer
    parser: ToolCallParser | HarmonyParser | None = None

    def __post_init__(self) -> None:
        fmt, tools = self.started.tool_call_format, self.spec.tools
        if fmt in CHANNELED:
            self.parser = HarmonyParser(tools.names if tools is not None else ())
        elif tools is not None and fmt:
            self.parser = ToolCallParser(fmt, tools.names, tools.parameters())

    def finish_reason(self, finished: Finished) -> str:
        """The engine's reason, or "tool_calls" where the answer ended with calls made."""
        if self.parser is not None and self.parser.calls and finished.reason == "stop":
            return "tool_calls"
        return finished.reason

    def on_delta(self, delta: Delta) -> None:
        self.first_token_at = self.outcome.first_token_at = (self.first_token_at
                                                             or self.outcome.clock())
        self.num_deltas += delta.num_tokens or 1
        self.outcome.output_tokens = self.num_deltas
        self.logprobs.extend(delta.logprobs)

    def figures(self, finished: Finished) -> Figures:
        s = finished.stats
        first = self.first_token_at or self.outcome.clock()
        return Figures(
            engine_id=self.started.engine_id,
            queue_wait_ms=self.queue_wait_s * 1e3, ttft_ms=(first - self.arrived_at) * 1e3,
            engine_queue_ms=s.queue_ms, decode_tok_s=s.decode_tok_s, expert_hit_rate=s.hit_rate,
            spill_ratio=s.spill_ratio, reused_prompt_tokens=s.reused_prompt_tokens,
            drafts_proposed=s.drafts_proposed, drafts_accepted=s.drafts_accepted,
            draft_acceptance_rate=s.draft_acceptance_rate)

    def usage(self, finished: Finished) -> dict[str, Any]:
        stats = finished.stats
        counted = usage(stats.prompt_tokens or self.started.prompt_tokens,
                        stats.completion_tokens or self.num_deltas, stats.reused_prompt_tokens)
        self.outcome.input_tokens = counted["prompt_tokens"]
        self.outcome.output_tokens = counted["completion_tokens"]
        return counted

    def log_done(self, finished: Finished) -> None:
        u, f = self.usage(finished), self.figures(finished)
        log.info("request %s done (%s): %d prompt + %d completion tokens, queue %.0f ms, "
                 "ttft %.0f ms, %.1f tok/s, expert hit rate %.3f, spilled %.3f (routed experts no "
                 "cache slot served), engine %s, trace %s",
                 request_id(self.request), finished.reason, u["prompt_tokens"],
                 u["completion_tokens"], f.queue_wait_ms, f.ttft_ms, f.decode_tok_s,
                 f.expert_hit_rate, f.spill_ratio, f.engine_id, self.request[TRACE].trace_id)


async def _generate(request: web.Request, endpoint: _Endpoint) -> web.StreamResponse:
    clock = request.app[CLOCK]
    outcome = _Outcome(endpoint.operation, clock, clock())
    try:
        return await _answer(request, endpoint, outcome)
    except BaseException as exc:
        outcome.fail(exc)
        if isinstance(exc, EngineError) and exc.param is not None:
            exc.param = endpoint.engine_param(exc.param)
        raise
    finally:
        if not outcome.detached:
            outcome.record(request.app[METRICS])


async def _answer(request: web.Request, endpoint: _Endpoint,
                  outcome: _Outcome) -> web.StreamResponse:
    app = request.app
    config, admission, pool, clock = app[CONFIG], app[ADMISSION], app[POOL], app[CLOCK]
    arrived_at = outcome.arrived_at
    deadline = arrived_at + config.request_timeout_s
    raw = None
    num_bytes = request.content_length
    if num_bytes is None:  # chunked upload: the size is only known once read (bounded)
        raw = await request.read()
        num_bytes = len(raw)
    ticket = await admission.enter(estimate_prompt_tokens(num_bytes))  # 429/503 before parsing
    engine_used = False
    try:
        spec = await endpoint.parse(request,
                                    json_body(raw if raw is not None else await request.read()))
        outcome.model = spec.model
        request[TRACE].span.set_attributes({"gen_ai.operation.name": outcome.operation,
                                            "gen_ai.request.model": spec.model})
        if spec.user is not None:
            request[TRACE].span.set_attribute("user.id", spec.user)
        _log_start(request, spec)
        served = await served_models(app)
        if spec.model not in served:  # the engines may have been restarted with another model
            await pool.probe_all()
            if spec.model not in (served := await served_models(app)):
                raise ModelNotFound(spec.model, served)
        await admission.reestimate(ticket, spec.prompt_estimate)
        await admission.place(ticket, spec.placement_key)
        if isinstance(spec, ResponsesInput) and spec.background:
            return await _detach(request, endpoint, spec, ticket, outcome)
        engine = await admission.acquire(ticket, min(config.queue_timeout_s,
                                                     deadline - clock()))
        engine_used = True
        return await _generate_at(request, endpoint, spec, ticket, engine, outcome)
    except asyncio.CancelledError:
        if outcome.detached:
            log.info("request %s: client left the stream of its background response after "
                     "%.0f ms; the response runs on", request_id(request),
                     (clock() - arrived_at) * 1e3)
        else:
            log.info("request %s: client went away after %.0f ms (%s); %s",
                     request_id(request), (clock() - arrived_at) * 1e3,
                     "engine call cancelled" if engine_used else "left the queue",
                     "its slot is free again" if engine_used else "nothing reached the engine")
        raise
    finally:
        if not outcome.detached:  # else the background run releases it
            admission.release(ticket, observed=engine_used)


async def _generate_at(request: web.Request, endpoint: _Endpoint, spec: GenerateInput,
                       ticket: Ticket, engine: str, outcome: _Outcome,
                       renderer: Any = None) -> web.StreamResponse:
    """The request's engine calls at its granted engine (a call a choice), then its reply
    (`renderer`: the endpoint's own by default)."""
    app = request.app
    config, admission, pool, clock = app[CONFIG], app[ADMISSION], app[POOL], app[CLOCK]
    deadline = outcome.arrived_at + config.request_timeout_s
    renderer = renderer or endpoint.renderer(request_id(request), spec)
    following = admission.forward(ticket)  # requests this gateway forwards after this one
    async with contextlib.AsyncExitStack() as calls:
        runs = []
        choices = spec.num_choices
        for i in range(choices):  # an engine request each: n a prompt, seeds apart
            call = await calls.enter_async_context(pool.generate(
                engine, _choice(spec, i), request_id(request) + (f"-{i}" if i else ""),
                following=following + choices - 1 - i,
                metadata=request[TRACE].metadata(),
                timeout_s=max(deadline - clock(), 0.001),
                # a whole answer is held at the engine to its end: one message, not one
                # a step (the first tokens still come at once: the TTFT is measured)
                stream_interval_ms=config.stream_interval_ms if spec.stream
                else config.request_timeout_s * 1e3))
            runs.append(_Run(request, spec, renderer, call,
                             await _started(call, engine, pool), outcome.arrived_at,
                             ticket.queue_wait_s, outcome))
        outcome.input_tokens = sum(run.started.prompt_tokens for run in runs[::spec.n])
        return await endpoint.reply(runs)


async def _detach(request: web.Request, endpoint: _Endpoint, spec: ResponsesInput,
                  ticket: Ticket, outcome: _Outcome) -> web.StreamResponse:
    """A background response: stored as queued and answered so at once (streamed: its event
    log, from the start, as a later GET with stream true would read it); a task of this
    gateway's runs it on under the same ticket (background.py), storing it as it goes."""
    store, caller = request.app[RESPONSE_STORE], owner(request)
    builder = ResponseBuilder(spec)
    builder.queue()
    await store.beat(spec.response_id, MARK_TTL_S)
    await store.put(spec.response_id, stored_record(builder, caller))
    if spec.stream:
        await store.append_events(spec.response_id, builder.take_events())
    request.app[BACKGROUND].start(spec.response_id, lambda run: _run_background(
        request, endpoint, spec, ticket, outcome, builder, run))
    outcome.detached = True
    log.info("request %s: background response %s queued", request_id(request), spec.response_id)
    if spec.stream:
        return await replay(request, spec.response_id, -1)
    return web.json_response(builder.response)


async def _run_background(request: web.Request, endpoint: _Endpoint, spec: ResponsesInput,
                          ticket: Ticket, outcome: _Outcome, builder: ResponseBuilder,
                          run: BackgroundRun) -> None:
    """A background response from its queue place to its stored end: completed or incomplete
    (stored by the Responses reply as any response is), failed (the error in it) or cancelled."""
    app = request.app
    config, admission, clock, store = app[CONFIG], app[ADMISSION], app[CLOCK], app[RESPONSE_STORE]
    caller, engine_used = owner(request), False

    async def put(status: str | None = None) -> None:
        record = stored_record(builder, caller)
        if status is not None:
            record["response"]["status"] = status
        await store.put(spec.response_id, record)

    try:
        engine = await admission.acquire(ticket, min(
            config.queue_timeout_s, outcome.arrived_at + config.request_timeout_s - clock()))
        engine_used = True
        await put("in_progress")
        await _generate_at(request, endpoint, spec, ticket, engine, outcome, builder)
        if builder.status == "failed":  # after its stream began: the error is in the builder
            await put()
        log.info("request %s: background response %s %s", request_id(request),
                 spec.response_id, builder.status)
    except asyncio.CancelledError as exc:
        outcome.fail(exc)
        if run.cancelled:  # its stream's readers see the record's status and end
            builder.status = "cancelled"
            log.info("request %s: background response %s cancelled", request_id(request),
                     spec.response_id)
        else:
            builder.fail({"message": STOPPED})
            if spec.stream:
                await store.append_events(spec.response_id, builder.take_events())
        await put()
        if not run.cancelled:
            raise
    except Exception as exc:  # noqa: BLE001 - stored in the response, as OpenAI does
        outcome.fail(exc)
        error = http_error(exc, request_id(request))
        log_failure(request, exc, error.status)
        builder.fail(error.body["error"])
        if spec.stream:
            await store.append_events(spec.response_id, builder.take_events())
        await put()
    finally:
        admission.release(ticket, observed=engine_used)
        outcome.record(app[METRICS])


def _choice(spec: GenerateInput, i: int) -> GenerateInput:
    """Choice i's engine request: prompt i // n; a seeded request's choices of a prompt draw
    with seed + i % n (so a batch answers as its prompts sent one by one would)."""
    prompt, k = divmod(i, spec.n)
    if len(spec.prompts) > 1:
        spec = replace(spec, prompts=(spec.prompts[prompt],))
    seed = spec.sampling.seed
    if k == 0 or seed is None:
        return spec
    return replace(spec, sampling=replace(spec.sampling, seed=(seed + k) % 2**64))


async def _started(call: GenerateCall, engine: str, pool: Any) -> Started:
    event = await call.next_event()  # a bad prompt fails here, before any output
    if not isinstance(event, Started):
        raise EngineError("INTERNAL", f"expected Started first, got {event!r}", engine)
    if not event.engine_id:
        status = pool.statuses.get(engine)
        event = replace(event, engine_id=status.engine_id if status else engine)
    return event


def _usage(runs: list[_Run], finished: list[Finished]) -> dict[str, Any]:
    """Each prompt once (its cached tokens: the most any of its choices reused), every
    choice's completion tokens."""
    counted = [run.usage(f) for run, f in zip(runs, finished, strict=True)]
    n = runs[0].spec.n
    per_prompt = [counted[p:p + n] for p in range(0, len(counted), n)]
    out = usage(sum(c[0]["prompt_tokens"] for c in per_prompt),
                sum(c["completion_tokens"] for c in counted),
                sum(max(x["prompt_tokens_details"]["cached_tokens"] for x in c)
                    for c in per_prompt))
    runs[0].outcome.output_tokens = out["completion_tokens"]
    return out


def json_body(raw: bytes) -> Any:
    """The body as JSON, strictly: NaN and Infinity are no JSON values (Python's parser takes
    them), and a number past Python's digit limit or nesting past its recursion limit is a
    400 like any other malformed body."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError too
        raise InvalidRequest(f"the request body is not valid JSON: {exc}",
                             code="invalid_json") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _log_start(request: web.Request, spec: GenerateInput) -> None:
    """Prompt text reaches the log only with --log-prompts."""
    if not request.app[CONFIG].log_prompts:
        return
    if spec.is_chat:
        prompt = json.dumps([{"role": m.role, "content": m.content} for m in spec.messages],
                            ensure_ascii=False)
    elif len(spec.prompts) == 1 and isinstance(spec.prompt, str):
        prompt = spec.prompt
    else:  # a batch, or token ids
        prompt = json.dumps(spec.prompts, ensure_ascii=False)
    log.info("request %s prompt: %s", request_id(request), prompt)


def _logprobs(run: _Run, logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...]
              ) -> list[TokenLogprob] | tuple[TokenLogprob, ...] | None:
    return logprobs if run.spec.sampling.logprobs else None


async def _collect(run: _Run) -> tuple[str, Finished]:
    """One choice's text (less its tool calls and reasoning, which the run's parser keeps) and
    its Finished event (non-streaming)."""
    parts: list[str] = []
    async for event in run.call.events():
        if isinstance(event, Echo):
            parts.append(event.text)
            run.logprobs.extend(event.logprobs)
        elif isinstance(event, Delta):
            run.on_delta(event)
            parts.append(event.text)
        elif isinstance(event, Finished):
            if event.reason == "abort":
                raise EngineAborted(event.error, run.call.engine)
            run.log_done(event)
            text = "".join(parts)
            if run.parser is not None:
                text = run.parser.feed(text)[0] + run.parser.finish()
            return text, event
    raise EngineError("INTERNAL", "the event stream ended without a Finished event",
                      run.call.engine)


async def _complete(runs: list[_Run]) -> web.Response:
    results = await asyncio.gather(*(_collect(run) for run in runs))
    finished = [f for _, f in results]
    figures = runs[0].figures(finished[0])
    body = runs[0].renderer.full_many(
        [(text, run.finish_reason(f), _logprobs(run, run.logprobs))
         for run, (text, f) in zip(runs, results, strict=True)],
        _usage(runs, finished), figures,
        tool_calls=[run.parser.calls if run.parser else [] for run in runs],
        reasoning=[run.parser.take_reasoning() if run.parser else "" for run in runs])
    return web.json_response(body, headers=figures.headers())


async def _batches(runs: list[_Run]) -> AsyncIterator[list[tuple[int, Any]]]:
    """The choices' events in the engine's order, in batches: whatever arrived while the
    previous batch was being written (a client reading slower than the engine produces gets
    fewer, larger events). Items are (choice, event), (choice, None) where a choice's stream
    ends, and (choice, exception) where it failed."""
    arrived: list[tuple[int, Any]] = []
    ready = asyncio.Event()

    async def pump(i: int, run: _Run) -> None:
        try:
            async for event in run.call.events():
                arrived.append((i, event))
                ready.set()
            arrived.append((i, None))
        except Exception as exc:  # noqa: BLE001 - raised again by the writer
            arrived.append((i, exc))
        ready.set()

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        ended = 0
        while ended < len(runs):
            await ready.wait()
            ready.clear()
            batch = arrived[:]
            arrived.clear()
            ended += sum(event is None or isinstance(event, Exception) for _, event in batch)
            yield batch
    finally:
        for task in tasks:
            task.cancel()


def _merged(batch: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """A batch with each choice's consecutive deltas joined into one (its order kept)."""
    out: list[tuple[int, Any]] = []
    deltas: dict[int, list[Delta]] = {}
    for i, event in batch:
        if isinstance(event, Delta):
            deltas.setdefault(i, []).append(event)
            continue
        if i in deltas:
            out.append((i, Delta.join(deltas.pop(i))))
        out.append((i, event))
    out.extend((i, Delta.join(d)) for i, d in deltas.items())
    return out


async def _event_stream(run: _Run) -> web.StreamResponse:
    """The SSE response of a streaming request, its headers sent."""
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Request-Id": request_id(run.request),
        "x-strata-queue-wait-ms": f"{run.queue_wait_s * 1e3:.3f}",
        "x-strata-engine-id": run.started.engine_id})
    await response.prepare(run.request)
    return response


async def _stream(runs: list[_Run]) -> web.StreamResponse:
    """SSE for n choices: each choice's chunks carry its index, in the engine's order, a
    batch of arrivals written at once; then (with include_usage) one usage chunk for all,
    then [DONE]. A failure after the headers goes out as an error event, and no [DONE].

    Every write is a send and a wake-up of the client: the headers go out when the engine
    has taken the request, the role chunks with the first tokens, and the last batch with
    [DONE] and the end of the body."""
    run0 = runs[0]
    response = await _event_stream(run0)
    renderer, finished = run0.renderer, {}
    out = [sse.event(renderer.chunk(first=True, index=i)) for i in range(len(runs))]
    try:
        async for batch in _batches(runs):
            for i, event in _merged(batch):
                run = runs[i]
                if isinstance(event, Exception):
                    raise event
                if event is None and i not in finished:
                    raise EngineError("INTERNAL", "the event stream ended without a "
                                      "Finished event", run.call.engine)
                if isinstance(event, Echo):
                    out.append(sse.event(renderer.chunk(
                        text=event.text, logprobs=_logprobs(run, event.logprobs), index=i)))
                elif isinstance(event, Delta):
                    run.on_delta(event)
                    text, calls = (event.text, []) if run.parser is None \
                        else run.parser.feed(event.text)
                    if run.parser is not None and (thought := run.parser.take_reasoning()):
                        out.append(sse.event(renderer.chunk(reasoning=thought, index=i)))
                    if text or event.logprobs or run.parser is None:
                        out.append(sse.event(renderer.chunk(
                            text=text, logprobs=_logprobs(run, event.logprobs), index=i)))
                    earlier = len(run.parser.calls) - len(calls) if run.parser else 0
                    out.extend(sse.event(renderer.tool_call_chunk(call, earlier + k, index=i))
                               for k, call in enumerate(calls))
                elif isinstance(event, Finished):
                    if event.reason == "abort":
                        raise EngineAborted(event.error, run.call.engine)
                    finished[i] = event
                    if run.parser is not None:
                        before = len(run.parser.calls)
                        rest = run.parser.finish()  # may close a call (harmony's last)
                        if thought := run.parser.take_reasoning():
                            out.append(sse.event(renderer.chunk(reasoning=thought, index=i)))
                        if rest:
                            out.append(sse.event(renderer.chunk(text=rest, index=i)))
                        out.extend(sse.event(renderer.tool_call_chunk(call, before + k,
                                                                      index=i))
                                   for k, call in enumerate(run.parser.calls[before:]))
                    out.append(sse.event(renderer.chunk(
                        finish_reason=run.finish_reason(event), figures=run.figures(event),
                        index=i)))
                    run.log_done(event)
            if out and len(finished) < len(runs):  # the last batch goes with the end
                await response.write(b"".join(out))
                out = []
        ordered = [finished[i] for i in range(len(runs))]
        if run0.spec.include_usage:
            out.append(sse.event(renderer.usage_chunk(_usage(runs, ordered),
                                                      run0.figures(ordered[0]))))
        out.append(sse.DONE)
        await response.write_eof(b"".join(out))
    except ConnectionResetError as exc:
        run0.outcome.fail(exc)
        log.info("request %s: client went away mid-stream; engine call cancelled",
                 request_id(run0.request))
    except Exception as exc:  # headers are sent: the error goes out as an event, and no [DONE]
        run0.outcome.fail(exc)
        error = http_error(exc, request_id(run0.request))
        log_failure(run0.request, exc, error.status)
        out.append(sse.event(error.body))  # what came before the failure goes out too
        with contextlib.suppress(ConnectionResetError):
            await response.write(b"".join(out))
    return response


async def _chat_reply(runs: list[_Run]) -> web.StreamResponse:
    return await (_stream(runs) if runs[0].spec.stream else _complete(runs))


async def _parse_chat(_: web.Request, body: Any) -> GenerateInput:
    return parse_chat(body)


async def _parse_completion(_: web.Request, body: Any) -> GenerateInput:
    return parse_completion(body)


_CHAT = _Endpoint("chat", _parse_chat, lambda rid, spec: ChatRenderer(rid, spec.model),
                  _chat_reply)
_COMPLETIONS = _Endpoint("text_completion", _parse_completion,
                         lambda rid, spec: CompletionRenderer(rid, spec.model), _chat_reply)


# -- the Responses API -------------------------------------------------------------------------


async def _parse_responses(request: web.Request, body: Any) -> GenerateInput:
    """The request as its prompt will be (response_routes.as_prompted)."""
    return await as_prompted(request, parse_responses(body))


_RESPONSES = _Endpoint("chat", _parse_responses, lambda _, spec: ResponseBuilder(spec),
                       lambda runs: _respond(runs[0]), engine_param)


async def _respond_delta(run: _Run, builder: ResponseBuilder, delta: Delta,
                         flush: Callable[[], Awaitable[None]]) -> None:
    """A delta into the response: its reasoning, its text, the calls it closed."""
    if run.parser is None:
        builder.text(delta.text, delta.logprobs)
        return
    text, calls = run.parser.feed(delta.text)
    builder.reasoning(run.parser.take_reasoning())
    if text or calls or delta.logprobs:  # the reasoning ends here: its summary first
        await _summarize(run, builder, flush)
    builder.text(text, delta.logprobs)
    for call in calls:
        builder.call(call)


async def _respond_end(run: _Run, builder: ResponseBuilder, finished: Finished,
                       flush: Callable[[], Awaitable[None]]) -> None:
    """What the parser held back, then the end: completed, or incomplete."""
    if run.parser is not None:
        before = len(run.parser.calls)
        rest = run.parser.finish()  # may close a call (harmony's last)
        builder.reasoning(run.parser.take_reasoning())
        await _summarize(run, builder, flush)
        builder.text(rest)
        for call in run.parser.calls[before:]:
            builder.call(call)
    counted = run.usage(finished)
    builder.finish(finished.reason, response_usage(
        counted["prompt_tokens"], counted["completion_tokens"] + builder.summary_tokens,
        counted["prompt_tokens_details"]["cached_tokens"], await _reasoning_tokens(run, builder)),
        run.figures(finished))
    run.log_done(finished)
    run.outcome.output_tokens += builder.summary_tokens  # the request metrics count them too


async def _summarize(run: _Run, builder: ResponseBuilder,
                     flush: Callable[[], Awaitable[None]]) -> None:
    """reasoning.summary: the open reasoning item's summary, written by the same engine in a
    second request (under the same admission lease) while the answer's own tokens wait in its
    stream; streamed as reasoning_summary events (nothing where none is asked for)."""
    reasoning = builder.needs_summary
    if not reasoning:
        return
    request, spec = run.request, builder.spec
    app = request.app
    config, clock = app[CONFIG], app[CLOCK]
    channeled = run.started.tool_call_format in CHANNELED
    parser = HarmonyParser(()) if channeled else None
    builder.summary_start()
    await flush()
    tokens = 0
    async with app[POOL].generate(
            run.call.engine, summary_request(spec, reasoning, channeled),
            request_id(request) + "-summary", metadata=request[TRACE].metadata(),
            timeout_s=max(run.arrived_at + config.request_timeout_s - clock(), 0.001),
            stream_interval_ms=config.stream_interval_ms if spec.stream
            else config.request_timeout_s * 1e3) as call:
        async for event in call.events():
            if isinstance(event, Delta):
                builder.summary_delta(parser.feed(event.text)[0] if parser else event.text)
                await flush()
            elif isinstance(event, Finished):
                if event.reason == "abort":
                    raise EngineAborted(event.error, call.engine)
                if parser is not None:
                    builder.summary_delta(parser.finish())
                tokens = event.stats.completion_tokens
                if event.reason == "length" and not builder.summary_text:
                    log.warning("request %s: the reasoning's summary is empty: the model "
                                "used its %d tokens before writing one", request_id(request),
                                tokens)
    builder.summary_done(tokens)
    await flush()


async def _reasoning_tokens(run: _Run, builder: ResponseBuilder) -> int:
    """The reasoning's tokens, as the engine's tokenizer counts its text (one Tokenize call,
    only for an answer with reasoning: the engine's messages do not say which of their tokens
    were thought)."""
    thought = builder.reasoning_text
    if not thought:
        return 0
    app = run.request.app
    try:
        ids = await tokenizer_call(app, run.call.engine, "Tokenize",
                                   engine_pb2.TokenizeRequest(text=thought),
                                   app[CONFIG].engine_timeout_s)
    except EngineError as exc:
        log.warning("request %s: usage.output_tokens_details.reasoning_tokens reported as 0: "
                    "the engine did not count the reasoning's tokens (%s)",
                    request_id(run.request), exc)
        return 0
    return len(ids.ids)


class _Events:
    """Where a streamed response's events go: its HTTP response as SSE, or, for a background
    response, the store's event log (read by whoever streams it: response_routes.replay)."""

    def __init__(self, response: web.StreamResponse | None, store: Any = None,
                 response_id: str = "") -> None:
        self.response, self.store, self.response_id = response, store, response_id

    async def write(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        if self.response is not None:
            await self.response.write(b"".join(sse.named(e) for e in events))
        else:
            await self.store.append_events(self.response_id, events)

    async def end(self, events: list[dict[str, Any]]) -> None:
        if self.response is not None:
            await self.response.write_eof(b"".join(sse.named(e) for e in events))
        else:
            await self.write(events)


async def _respond(run: _Run) -> web.StreamResponse:
    """The Responses API's answer: the engine's events through a ResponseBuilder, streamed as
    named SSE events (`response.created` ... `response.completed`) or returned as one object.
    With `store` the record is written before the last event leaves, so a client that reads
    it back at once finds it. A failure after the stream began is `response.failed`."""
    request, builder = run.request, run.renderer
    spec: ResponsesInput = builder.spec
    sink = None
    if spec.stream:
        sink = (_Events(None, request.app[RESPONSE_STORE], spec.response_id) if spec.background
                else _Events(await _event_stream(run)))

    async def flush() -> None:
        if sink is not None:
            await sink.write(builder.take_events())

    builder.start()
    try:
        async for batch in _batches([run]):
            for _, event in _merged(batch):
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, Delta):
                    run.on_delta(event)
                    await _respond_delta(run, builder, event, flush)
                elif isinstance(event, Finished):
                    if event.reason == "abort":
                        raise EngineAborted(event.error, run.call.engine)
                    await _respond_end(run, builder, event, flush)
                    store = request.app[RESPONSE_STORE]
                    if spec.store:
                        await store.put(spec.response_id, stored_record(builder, owner(request)))
                    if spec.conversation_id is not None:  # the turn joins its conversation
                        await store.append_items(spec.conversation_id,
                                                 [*spec.input_items, *builder.output])
                elif event is None and builder.status == "in_progress":
                    raise EngineError("INTERNAL", "the event stream ended without a "
                                      "Finished event", run.call.engine)
            if builder.status == "in_progress":
                await flush()
        if sink is not None:
            await sink.end(builder.take_events())
    except ConnectionResetError as exc:
        if sink is None:
            raise
        run.outcome.fail(exc)
        log.info("request %s: client went away mid-stream; engine call cancelled",
                 request_id(request))
    except Exception as exc:
        if sink is None:
            raise
        run.outcome.fail(exc)
        error = http_error(exc, request_id(request))
        log_failure(request, exc, error.status)
        builder.fail(error.body["error"])
        with contextlib.suppress(ConnectionResetError):
            await sink.end(builder.take_events())
    if sink is None or sink.response is None:
        return web.json_response(builder.response, headers=builder.figures.headers()
                                 if builder.figures else None)
    return sink.response
