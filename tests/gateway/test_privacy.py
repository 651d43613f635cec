"""No request or completion text in the log by default, gateway and engine: a secret sent in a
prompt, in chat messages, in a stop string and in invalid fields (400s whose messages quote it,
from the gateway's parser and from an engine), and the completion's text, appear in no log line
at INFO or above and in nothing printed. Every logger is captured, the engine's thread too."""

from __future__ import annotations

import json
import logging

import aiohttp
import grpc
import pytest

from .conftest import ScriptedEngine, real_engine, start_engine

SECRET = "zebra-7f3a-private"
SCRIPTED_TOKENS = ["Quokka", "-", "completion", "-", "91ce"]  # the scripted engine's answer
FORCED = "Q"  # the real engine's only token, by logit_bias: its answer is FORCED * MAX_TOKENS
MAX_TOKENS = 16
REFUSE = "please refuse"  # the quoting engine refuses a prompt with this, quoting it


class QuotingEngine(ScriptedEngine):
    """Refuses a prompt that asks for it with an error quoting the prompt, as a chat template's
    error may."""

    async def Generate(self, request, context):
        prompt = request.prompt or " ".join(m.content for m in request.chat.messages)
        if REFUSE in prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot render {prompt!r}")
        async for event in super().Generate(request, context):
            yield event


@pytest.fixture(params=["scripted", "real"])
async def served(request, tiny_checkpoint):
    """(engine address, the answer every request gets, request fields that make it so): the
    quoting scripted engine, or the real engine core behind its gRPC server in this process
    (its loop thread logs into the captured loggers), its answer forced by logit_bias."""
    if request.param == "scripted":
        server, port = await start_engine(QuotingEngine(tokens=SCRIPTED_TOKENS))
        yield f"127.0.0.1:{port}", "".join(SCRIPTED_TOKENS), {}
        await server.stop(grace=None)
        return
    async with real_engine(tiny_checkpoint, "engine-private") as (address, _, _):
        yield (address, FORCED * MAX_TOKENS,
               {"logit_bias": {str(ord(FORCED)): 100}, "ignore_eos": True, "temperature": 0})


def _requests(model: str, extra: dict) -> list[tuple[str, dict]]:
    """Every way the secret reaches the gateway in a request that is answered 200."""
    chat = {"model": model, "messages": [{"role": "system", "content": f"keep {SECRET}"},
                                         {"role": "user", "content": f"say {SECRET}"}],
            "stop": [SECRET], "max_tokens": MAX_TOKENS, **extra}
    text = {"model": model, "prompt": f"continue {SECRET}", "stop": SECRET,
            "max_tokens": MAX_TOKENS, **extra}
    return [("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
            ("/v1/completions", text), ("/v1/completions", {**text, "stream": True})]


def _invalid(model: str) -> list[tuple[str, dict]]:
    """Requests the gateway's parser refuses with a message quoting the secret."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return [("/v1/chat/completions", {**chat, "temperature": SECRET}),
            ("/v1/chat/completions", {**chat, "messages": [{"role": SECRET, "content": "hi"}]}),
            ("/v1/chat/completions", {**chat, "response_format": {"type": SECRET}}),
            ("/v1/chat/completions", {**chat, "logit_bias": {SECRET: 1}}),
            ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": SECRET}),
            ("/v1/chat/completions", {**chat, "model": SECRET})]  # 404 quoting the model


async def _text(resp) -> str:
    """A 200's generated text, from a JSON body or an SSE stream."""
    if resp.content_type == "text/event-stream":
        raw = (await resp.read()).decode()
        assert raw.rstrip().endswith("data: [DONE]"), raw
        chunks = [json.loads(line[6:]) for line in raw.splitlines()
                  if line.startswith("data: {")]
        return "".join(c["choices"][0].get("delta", {}).get("content") or
                       c["choices"][0].get("text") or "" for c in chunks if c["choices"])
    choice = (await resp.json())["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _logged(caplog, level: int) -> str:
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    return "\n".join(formatter.format(r) for r in caplog.records if r.levelno >= level)


async def test_no_request_or_completion_text_in_the_log(served, make_gateway, caplog, capsys):
    caplog.set_level(logging.DEBUG)  # every logger; the assertions below read INFO and up
    address, answer, extra = served
    base = await make_gateway(engine_addrs=(address,))
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/v1/models") as resp:
            [model] = [m["id"] for m in (await resp.json())["data"]]
        for path, body in _requests(model, extra):
            async with http.post(base + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert await _text(resp) == answer  # what must not be logged, verbatim
        for path, body in _invalid(model):
            async with http.post(base + path, json=body) as resp:
                assert resp.status in (400, 404), body
                assert SECRET in (await resp.json())["error"]["message"]  # it quotes the secret
        if not extra:  # the scripted engine: its refusal quotes the prompt
            refused = {"model": model, "prompt": f"{REFUSE} {SECRET}"}
            async with http.post(base + "/v1/completions", json=refused) as resp:
                assert resp.status == 400 and SECRET in (await resp.json())["error"]["message"]
    printed = capsys.readouterr()
    logged = _logged(caplog, logging.INFO)
    assert "request" in logged and "-> 400" in logged  # the requests were logged, text-free
    assert SECRET not in logged and answer not in logged, logged
    assert SECRET not in printed.out + printed.err and answer not in printed.out + printed.err
    # The refusals' messages are still there for debugging, at DEBUG only.
    assert SECRET in _logged(caplog, logging.DEBUG)
