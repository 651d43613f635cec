"""Property tests of the request parser and the HTTP edge: whatever arrives, the answer is a
result or a 4xx envelope, never a crash or a 5xx, and the gateway keeps serving."""

import json

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.errors import InvalidRequest
from services.gateway.schemas import GenerateInput, parse_chat, parse_completion

from .conftest import MODEL
from .test_overload import BODY, _health

KEYS = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens",
        "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop",
        "logprobs", "top_logprobs", "response_format", "presence_penalty", "frequency_penalty",
        "logit_bias", "echo", "suffix", "best_of", "tools", "user"]

scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                           max_leaves=12)
message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(
    ["system", "developer", "user", "assistant", "tool", ""]) | json_values,
    "content": st.text(max_size=30) | json_values})
VALID = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt": "once"}


@st.composite
def bodies(draw):
    """Mostly near-valid bodies with some fields replaced; sometimes any JSON at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    body = dict(VALID)
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=5, unique=True)):
        if key == "messages":
            body[key] = draw(st.lists(message, max_size=3) | json_values)
        else:
            body[key] = draw(json_values)
    return body


@settings(max_examples=400, deadline=None)
@given(bodies())
def test_parser_returns_input_or_invalid_request(body):
    for parse in (parse_chat, parse_completion):
        try:
            spec = parse(body)
        except InvalidRequest as exc:
            assert 400 <= exc.status < 500 and exc.message
        else:
            assert isinstance(spec, GenerateInput)
            s = spec.sampling
            assert 0 <= s.temperature <= 2 and 0 < s.top_p <= 1 and 0 <= s.top_k <= 2**31 - 1
            assert 0 <= s.max_tokens <= 2**31 - 1 and 0 <= s.top_logprobs <= 20
            assert s.seed is None or 0 <= s.seed < 2**64


@settings(max_examples=60, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       raw=st.booleans())
async def test_http_never_answers_5xx(gateway, body, path, raw):
    data = json.dumps(body).encode() if not raw else json.dumps(body)[:-1].encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway + path, data=data,
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status < 500, await resp.text()
            if resp.content_type == "text/event-stream":  # a valid body asking to stream
                assert resp.status == 200
                assert (await resp.text()).rstrip().endswith("data: [DONE]")
            else:
                payload = await resp.json(content_type=None)
                if resp.status >= 400:
                    assert set(payload["error"]) == {"message", "type", "param", "code"}
        health = await _health(http, gateway)
        assert (health["inflight"], health["queued"]) == (0, 0)
        async with http.post(gateway + "/v1/chat/completions", json=BODY) as resp:
            assert resp.status == 200
