"""Speculative decoding in the families that need more than the engine's generic path:
Qwen3-Next's Gated DeltaNet state per sequence is rewound to the accepted prefix after every
verification step (greedy output is plain decoding's whatever the drafts), and `--spec-method
mtp` drafts from the checkpoint's own MTP layer (Qwen3-Next's `mtp.*`, DeepSeek-V3's and
GLM-4.5's layer num_hidden_layers), checked against references built from transformers' own
parts of each family on tiny random checkpoints."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from services.engine.core import Engine
from services.engine.runner import ModelRunner
from services.engine.spec.base import DraftRequest, DraftSource
from tests.engine.conftest import TOKENIZER_VOCAB
from tests.engine.test_batching import run_all
from tests.engine.test_model_families import make_family_checkpoint
from tests.engine.test_spec_engine import request

PROMPTS = ["The expert cache holds", "abcabcabc", "def f(x):\n    return", "a"]


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    model_dir, _ = make_family_checkpoint(tmp_path_factory.mktemp("q3n") / "qwen3_next",
                                          "qwen3_next", seed=3)
    return model_dir


def serve(model_dir, prompts, max_tokens=12, draft_source=None, spec_tokens=0,
          max_running=4, **runner_kwargs) -> list:
    runner = ModelRunner(model_dir, cache_slots=10**9, reserved_bytes=0, dtype="fp32",
                         **runner_kwargs)
    engine = Engine(runner, max_running=max_running, max_step_tokens=32,
                    draft_source=draft_source, spec_tokens=spec_tokens)
    engine.start()
    try:
        return run_all(engine, [request(p, max_tokens=max_tokens) for p in prompts])
    finally:
        engine.stop()


class MixedDraft(DraftSource):
    """Drafts from the plain greedy continuations: right for a while, then wrong, so that
    steps accept all, some and none of their drafts."""

    method = "mixed"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations  # prompt ids -> plain greedy tokens

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts = []
        for r in requests:
            want = self.continuations[tuple(r.token_ids[:r.prompt_len])]
            done = len(r.token_ids) - r.prompt_len
            right = want[done:done + r.max_tokens]
            keep = done % (r.max_tokens + 1)  # 0 .. max_tokens right, then one wrong
            draft = right[:keep] + [(t + 1) % 256 for t in right[keep:keep + 1]]
            drafts.append(draft[:r.max_tokens])
        return drafts


@pytest.mark.parametrize("max_running", [1, 4])
def test_rejected_drafts_rewind_the_linear_attention_state(qwen3_next_dir, max_running):
    """Drafts accepted in full, in part and not at all, alone and batched: the tokens plain
    decoding gives (a state left at a rejected draft would change every later token)."""
    plain = serve(qwen3_next_dir, PROMPTS)
    from services.engine.model.tokenizer import Tokenizer

    tok = Tokenizer(qwen3_next_dir)
    source = MixedDraft({tuple(tok.encode(p)): c.tokens for p, c in zip(PROMPTS, plain,
                                                                         strict=True)})
    spec = serve(qwen3_next_dir, PROMPTS, draft_source=source, spec_tokens=3,
                 max_running=max_running)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    stats = [c.finished.stats for c in spec]
    proposed = sum(s.drafts_proposed for s in stats)
    accepted = sum(s.drafts_accepted for s in stats)
    assert 0 < accepted < proposed


# -- the checkpoint's own MTP layer (--spec-method mtp) ---------------------------------------
def _init(module: torch.nn.Module, norm_center: float) -> None:
    """Parts built outside a PreTrainedModel are not initialized: random weights that count,
    norms around `norm_center` ((1 + w) norms: 0), routing biases that matter."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(norm_center, 0.2)
            else:
                p.normal_(0.0, 0.1)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)


def _causal(main, x: torch.Tensor) -> dict:
    T = x.shape[1]
    positions = torch.arange(T)[None]
    return dict(attention_mask=torch.full((T, T), float("-inf")).triu(1)[None, None],
                position_ids=positions, position_embeddings=main.model.rotary_emb(x, positions))


class QwenMtp(torch.nn.Module):
    """Qwen3-Next's MTP module as vLLM runs it, from transformers' own Qwen3Next parts:
    fc([enorm(embed(x_{t+1})); hnorm(h_t)]) -> a full-attention decoder layer (gated
    attention, sparse MoE with a shared expert) -> norm -> the main lm_head; a later round
    reads the normed output."""

    def __init__(self, config):
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.fc = torch.nn.Linear(2 * D, D, bias=False)
        self.pre_fc_norm_embedding = m.Qwen3NextRMSNorm(D, eps=eps)
        self.pre_fc_norm_hidden = m.Qwen3NextRMSNorm(D, eps=eps)
        self.layers = torch.nn.ModuleList([m.Qwen3NextDecoderLayer(
            config, config.layer_types.index("full_attention"))])
        self.norm = m.Qwen3NextRMSNorm(D, eps=eps)
        _init(self, 0.0)

    def stored(self) -> dict[str, torch.Tensor]:
        return {f"mtp.{k}": v for k, v in self.state_dict().items()}

    def forward(self, main, ids, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] (token t+1 at position t), hidden [T, D] (h_t after the main final norm),
        causal over positions 0..T-1 -> (what a later round reads [T, D], logits [T, V])."""
        e = self.pre_fc_norm_embedding(main.model.embed_tokens(ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))[None]
        g = self.norm(self.layers[0](x, **_causal(main, x))[0])
        return g, main.lm_head(g)


class NextnMtp(torch.nn.Module):
    """DeepSeek-V3's / GLM-4.5's MTP layer (layer num_hidden_layers) as vLLM runs it, from
    transformers' own parts: the embedding zeroed at position 0, eh_proj([enorm(e); hnorm(h)]),
    the family's decoder layer, then shared_head (norm, head); a later round reads the output
    before the norm."""

    def __init__(self, config, family: str):
        import transformers.models.deepseek_v3.modeling_deepseek_v3 as ds
        import transformers.models.glm4_moe.modeling_glm4_moe as glm

        super().__init__()
        norm, layer = {"glm4_moe": (glm.Glm4MoeRMSNorm, glm.Glm4MoeDecoderLayer),
                       "deepseek_v3": (ds.DeepseekV3RMSNorm, ds.DeepseekV3DecoderLayer)}[family]
        D, eps = config.hidden_size, config.rms_norm_eps
        self.index = config.num_hidden_layers
        self.enorm, self.hnorm = norm(D, eps=eps), norm(D, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
        self.block = layer(config, self.index)
        self.shared_head = torch.nn.ModuleDict(dict(
            norm=norm(D, eps=eps), head=torch.nn.Linear(D, config.vocab_size, bias=False)))
        _init(self, 1.0)

    def stored(self) -> dict[str, torch.Tensor]:
        p = f"model.layers.{self.index}."
        return {p + k.removeprefix("block."): v for k, v in self.state_dict().items()}

    def forward(self, main, ids, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        e = main.model.embed_tokens(ids).clone()
        e[0] = 0  # position 0
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))[None]
        y = self.block(x, **_causal(main, x))[0]
        return y, self.shared_head["head"](self.shared_head["norm"](y))


MTP_FAMILIES = ["qwen3_next", "glm4_moe", "deepseek_v3"]


@pytest.fixture(scope="module", params=MTP_FAMILIES)
def mtp_dir(request, tmp_path_factory):
    """A tiny checkpoint with its MTP layer in a shard of its own, named as released (mtp.*
    beside the model; DeepSeek / GLM: layer num_hidden_layers), which transformers does not
    load."""
    from safetensors.torch import save_file

    family = request.param
    model_dir, ref = make_family_checkpoint(tmp_path_factory.mktemp("mtp") / family, family,
                                            seed=5, _attn_implementation="eager")
    torch.manual_seed(11)
    mtp = (QwenMtp(ref.config) if family == "qwen3_next" else NextnMtp(ref.config, family))
    save_file({k: v.contiguous() for k, v in mtp.eval().stored().items()},
              str(model_dir / "model-mtp.safetensors"))
    return model_dir, ref, mtp


def reference_drafts(ref, mtp, tokens: list[int], k: int) -> list[int]:
    """k greedy drafts after tokens x_0..x_n: the main model's hidden states of x_0..x_{n-1},
    then the MTP module over every position from scratch each round."""
    with torch.no_grad():
        hidden = ref.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]  # after the norm
        ids, drafts = list(tokens[1:]), []
        for _ in range(k):
            g, logits = mtp(ref, torch.tensor(ids), hidden)
            drafts.append(int(logits[-1, :TOKENIZER_VOCAB].argmax()))
            ids.append(drafts[-1])
            hidden = torch.cat([hidden, g[-1:]])  # the MTP's own output stands in
    return drafts


def test_the_checkpoint_mtp_layer_drafts_what_transformers_parts_compute(mtp_dir):
    """--spec-method mtp on a checkpoint with its own MTP layer: three greedy drafts after a
    prompt, after a step of accepted and rejected drafts, for two sequences in one batch —
    each what the reference computes from scratch (full causal attention, no cache)."""
    from services.engine.runner import ChunkWork
    from services.engine.spec import draft_memory_bytes, make_draft_source
    from services.engine.spec.checkpoint_mtp import CheckpointMtp

    model_dir, ref, mtp = mtp_dir
    runner = ModelRunner(model_dir, cache_slots=10**9, reserved_bytes=0, dtype="fp32")
    source = make_draft_source("mtp", runner=runner)
    assert isinstance(source, CheckpointMtp)
    assert draft_memory_bytes("mtp", model_dir=model_dir, device="cpu") == source.memory_bytes
    prompts = [runner.tokenizer.encode(p) for p in ("The expert cache holds", "abcabc")]
    tables = [list(range(0, 4)), list(range(4, 8))]
    for seq_id, ids in enumerate(prompts):  # prefill; the first token greedy
        (logits, _), = runner.step([ChunkWork(ids, 0, tables[seq_id], True, True,
                                              seq_id=seq_id)])
        ids.append(int(logits.argmax()))
    requests = [DraftRequest(i, ids, len(ids) - 1, 3) for i, ids in enumerate(prompts)]
    drafts = source.propose(requests)
    assert drafts == [reference_drafts(ref, mtp, ids, 3) for ids in prompts]
    # verify [last, d1, d2, d3] of each: keep what the main model agrees with, then draft on
    work = [ChunkWork([ids[-1], *d], len(ids) - 1, tables[i], False, True, num_draft=3,
                      seq_id=i) for i, (ids, d) in enumerate(zip(prompts, drafts, strict=True))]
    for ids, d, (logits, _) in zip(prompts, drafts, runner.step(work), strict=True):
        greedy = logits.argmax(dim=-1).tolist()
        ids.append(greedy[0])
        for j, token in enumerate(d):
            if token != greedy[j]:
                break
            ids.append(greedy[j + 1])
    requests = [DraftRequest(i, ids, len(ids) - 1, 3) for i, ids in enumerate(prompts)]
    assert source.propose(requests) == [reference_drafts(ref, mtp, ids, 3) for ids in prompts]
    assert source.draft_lookups > 0  # the MTP layer's own experts, not the main cache's


def test_mtp_speculation_gives_plain_greedy_output(mtp_dir):
    """`--spec-method mtp` from the checkpoint's own layer, alone and batched: the tokens of
    plain decoding; drafts proposed and checked."""
    from services.engine.spec import make_draft_source

    model_dir, _, _ = mtp_dir
    plain = serve(model_dir, PROMPTS, max_tokens=16)
    for max_running in (1, 4):
        runner = ModelRunner(model_dir, cache_slots=10**9, reserved_bytes=0, dtype="fp32")
        engine = Engine(runner, max_running=max_running, max_step_tokens=32,
                        draft_source=make_draft_source("mtp", runner=runner), spec_tokens=3)
        engine.start()
        try:
            spec = run_all(engine, [request(p, max_tokens=16) for p in PROMPTS])
        finally:
            engine.stop()
        assert [c.tokens for c in spec] == [c.tokens for c in plain]
        assert sum(c.finished.stats.drafts_proposed for c in spec) > 0
        assert engine.totals.draft_lookups > 0
