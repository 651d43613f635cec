"""`strata up --model DIR` on a tiny random checkpoint of each family beyond qwen3_moe (the
default model's, served by test_cluster.py): the official `openai` client gets transformers'
greedy continuation, streamed and not."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from openai import OpenAI  # noqa: E402

from services.engine.model.tokenizer import Tokenizer  # noqa: E402
from tests.e2e.conftest import start_cluster, stop_cluster  # noqa: E402
from tests.engine.conftest import TOKENIZER_VOCAB  # noqa: E402
from tests.engine.test_model_families import FAMILIES, make_family_checkpoint  # noqa: E402

PROMPT = "Routing picks four experts for every token, and"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_strata_up_serves_the_family_as_transformers_generates(tmp_path, family):
    model_dir, ref = make_family_checkpoint(tmp_path / family, family, seed=6)
    ids = Tokenizer(model_dir).encode(PROMPT)
    want: list[int] = []
    for _ in range(12):  # greedy over the tokenizer's ids, as the engine samples
        with torch.no_grad():
            logits = ref(torch.tensor([ids + want])).logits[0, -1, :TOKENIZER_VOCAB]
        want.append(int(logits.argmax()))
    cluster = start_cluster(tmp_path, "--model", str(model_dir))  # fp32, as stored
    try:
        client = OpenAI(base_url=cluster.base_url, api_key="none")
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                          temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    finally:
        assert stop_cluster(cluster) == 0, cluster.output.read_text()
    text = Tokenizer(model_dir).decode(want)
    assert reply.choices[0].text == text == streamed
    assert reply.usage.completion_tokens == 12
