"""API keys from a file of hashes, the body-size limit, prompts kept out of logs."""

import hashlib
import logging

import aiohttp
import pytest
from openai import AsyncOpenAI, AuthenticationError

from services.common.settings import ConfigError
from services.gateway.config import load_key_file
from services.gateway.middleware import ApiKeys

from .conftest import MODEL
from .test_overload import BODY

SECRET_PROMPT = "my-secret-prompt-text"


def test_key_file_holds_hashes(tmp_path):
    path = tmp_path / "keys"
    digest = hashlib.sha256(b"sk-good").hexdigest()
    path.write_text(f"# strata keys\n{digest}\nsha256:{'ab' * 32}  # ops\n\n")
    hashes = load_key_file(str(path))
    assert len(hashes) == 2
    keys = ApiKeys(hashes)
    assert keys.accepts("sk-good") and not keys.accepts("sk-bad") and not keys.accepts("")
    path.write_text("sk-plaintext-key\n")
    with pytest.raises(ValueError, match="SHA-256"):
        load_key_file(str(path))


async def test_api_keys_file(make_gateway, tmp_path):
    path = tmp_path / "keys"
    path.write_text(hashlib.sha256(b"sk-good").hexdigest() + "\n")
    base = await make_gateway(api_key_hashes=load_key_file(str(path)))
    async with AsyncOpenAI(base_url=base + "/v1", api_key="sk-good", max_retries=0) as good:
        reply = await good.chat.completions.create(model=MODEL, messages=BODY["messages"])
        assert reply.choices[0].message.content == "Hello, world!"
    async with AsyncOpenAI(base_url=base + "/v1", api_key="sk-bad", max_retries=0) as bad:
        with pytest.raises(AuthenticationError):
            await bad.chat.completions.create(model=MODEL, messages=BODY["messages"])
    async with aiohttp.ClientSession() as http:
        for path in ("/livez", "/readyz", "/health", "/openapi.json"):  # probes need no key
            async with http.get(base + path) as resp:
                assert resp.status == 200, path


def test_bad_key_file_names_the_setting(tmp_path):
    from tests.gateway.test_config import config

    with pytest.raises(ConfigError, match="STRATA_API_KEYS_FILE"):
        config([], {"STRATA_API_KEYS_FILE": str(tmp_path / "missing")})


async def test_body_size_limit(make_gateway, engine):
    servicer, _ = engine
    base = await make_gateway(max_body_bytes=1000)
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 2000}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(base + "/v1/chat/completions", json=big) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "request_too_large"

        async def chunks():  # no Content-Length: caught while reading
            for _ in range(4):
                yield b" " * 400
        async with http.post(base + "/v1/chat/completions", data=chunks()) as resp:
            assert resp.status == 413
            assert "error" in await resp.json()
        async with http.post(base + "/v1/chat/completions", json=BODY) as resp:
            assert resp.status == 200
    assert len(servicer.requests) == 1


@pytest.mark.parametrize("log_prompts", [False, True])
async def test_prompts_stay_out_of_logs_unless_asked(make_gateway, caplog, log_prompts):
    """Both routes' prompts reach the log only with --log-prompts (every route's request is a
    valid one, so it gets as far as the line that would log it)."""
    caplog.set_level(logging.DEBUG)
    base = await make_gateway(log_prompts=log_prompts)
    chat = {**BODY, "messages": [{"role": "user", "content": SECRET_PROMPT + "-chat"}]}
    text = {"model": MODEL, "prompt": SECRET_PROMPT + "-text", "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", text)):
            async with http.post(base + path, json=body) as resp:
                assert resp.status == 200
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert [f"{SECRET_PROMPT}-{route}" in logged for route in ("chat", "text")] == [
        log_prompts] * 2
