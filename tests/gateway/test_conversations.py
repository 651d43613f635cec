"""The Conversations API with the official openai client: made, read, updated and deleted, its
items added, listed and removed, continued by Responses requests (the engine sees the whole
conversation; each answered turn joins it), kept per API key, and shared by gateway replicas
through Redis."""

import openai
import pytest

from .conftest import MODEL


def _client(base: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


def _user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def test_a_conversations_items_are_made_listed_and_removed(engine, make_gateway):
    base = await make_gateway()
    async with _client(base) as client:
        conv = await client.conversations.create(items=[_user("hi"), _user("there")],
                                                 metadata={"topic": "demo"})
        assert conv.id.startswith("conv_") and conv.metadata == {"topic": "demo"}
        assert (await client.conversations.retrieve(conv.id)).created_at == conv.created_at
        added = await client.conversations.items.create(conv.id, items=[_user("more")])
        assert [i.content[0].text for i in added.data] == ["more"]
        listed = [i async for i in client.conversations.items.list(conv.id, order="asc")]
        assert [i.content[0].text for i in listed] == ["hi", "there", "more"]
        page = await client.conversations.items.list(conv.id, limit=2)  # newest first
        assert [i.content[0].text for i in page.data] == ["more", "there"] and page.has_more
        one = await client.conversations.items.retrieve(listed[1].id, conversation_id=conv.id)
        assert one.content[0].text == "there"
        after = await client.conversations.items.delete(listed[1].id, conversation_id=conv.id)
        assert after.id == conv.id
        listed = [i async for i in client.conversations.items.list(conv.id, order="asc")]
        assert [i.content[0].text for i in listed] == ["hi", "more"]
        with pytest.raises(openai.NotFoundError):
            await client.conversations.items.retrieve(one.id, conversation_id=conv.id)
        with pytest.raises(openai.NotFoundError):  # a conversation is no response
            await client.responses.retrieve(conv.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(conv.id)
        updated = await client.conversations.update(conv.id, metadata={"topic": "changed"})
        assert updated.metadata == {"topic": "changed"}
        assert len([i async for i in client.conversations.items.list(conv.id)]) == 2
        deleted = await client.conversations.delete(conv.id)
        assert deleted.deleted and deleted.id == conv.id
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(conv.id)
        with pytest.raises(openai.BadRequestError) as too_many:
            await client.conversations.create(items=[_user(str(i)) for i in range(21)])
        assert too_many.value.body["param"] == "items"
        with pytest.raises(openai.BadRequestError) as unknown:
            await client.post("/conversations", cast_to=object, body={"title": "x"})
        assert unknown.value.body["param"] == "title"


async def test_responses_continue_a_conversation_and_join_it(engine, make_gateway):
    servicer, _ = engine
    servicer.context_window = 1000
    base = await make_gateway()
    async with _client(base) as client:
        conv = await client.conversations.create(items=[_user("my name is Ada")])
        first = await client.responses.create(model=MODEL, input="what is my name?",
                                              conversation=conv.id, store=False)
        assert first.conversation.id == conv.id
        sent = servicer.requests[-1].chat.messages
        assert [m.content for m in sent] == ["my name is Ada", "what is my name?"]
        stream = await client.responses.create(model=MODEL, input="and again?",
                                               conversation={"id": conv.id}, stream=True)
        assert [e async for e in stream][-1].type == "response.completed"
        sent = servicer.requests[-1].chat.messages
        assert [(m.role, m.content) for m in sent] == [
            ("user", "my name is Ada"), ("user", "what is my name?"),
            ("assistant", "Hello, world!"), ("user", "and again?")]
        items = [i async for i in client.conversations.items.list(conv.id, order="asc")]
        assert [i.type for i in items] == ["message"] * 5
        counted = await client.responses.input_tokens.count(model=MODEL, input="last",
                                                            conversation=conv.id)
        last = await client.responses.create(model=MODEL, input="last", conversation=conv.id)
        assert counted.input_tokens == last.usage.input_tokens
        with pytest.raises(openai.BadRequestError) as both:
            await client.responses.create(model=MODEL, input="x", conversation=conv.id,
                                          previous_response_id=last.id)
        assert both.value.body["param"] == "conversation"
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.create(model=MODEL, input="x",
                                          conversation="conv_" + "0" * 32)
        assert gone.value.body["param"] == "conversation"


async def test_a_conversation_is_its_keys_and_every_replica_reads_it(engine, make_gateway,
                                                                     redis_server):
    keys = {"key-a", "key-b"}
    here = await make_gateway(redis_url=redis_server.url, api_keys=frozenset(keys))
    other = await make_gateway(redis_url=redis_server.url, api_keys=frozenset(keys))
    async with _client(here, "key-a") as a, _client(other, "key-a") as a_there, \
            _client(other, "key-b") as b:
        conv = await a.conversations.create(items=[_user("hi")])
        await a.responses.create(model=MODEL, input="next", conversation=conv.id)
        listed = [i async for i in a_there.conversations.items.list(conv.id)]
        assert len(listed) == 3
        with pytest.raises(openai.NotFoundError):
            await b.conversations.retrieve(conv.id)
        with pytest.raises(openai.NotFoundError):
            await b.responses.create(model=MODEL, input="x", conversation=conv.id)
