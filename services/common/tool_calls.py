"""The tool-call syntaxes Strata knows, shared by the engine (which detects a chat template's
and builds grammars for it) and the gateway (which parses calls out of the text).

    hermes        <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (Qwen2.5/Qwen3)
    glm45         <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>
                  (GLM-4.5/4.6/4.7: a string V as written, any other value as JSON)
    qwen3_xml     <tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n...</function>\n
                  </tool_call>   (Qwen3-Coder, Qwen3.5: V as glm45's)
    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n
                  {...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>   (DeepSeek-V3-0324, R1-0528)
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
                  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>   (DeepSeek-V3.1, V3.2)
    minimax_m2    <minimax:tool_call>\n<invoke name="NAME">\n<parameter name="K">V</parameter>\n
                  ...</invoke>\n...</minimax:tool_call>   (MiniMax-M2: V as glm45's)
    kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I
                  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>
                  (Kimi-K2: the call's id is functions.NAME:I, and the history's ids must be)
    harmony       <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
                  (gpt-oss: every answer is channeled messages, gateway/harmony.py)
"""

from __future__ import annotations

DS_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DS_CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
DS_SEP = "<｜tool▁sep｜>"
KIMI_CALLS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
KIMI_CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
MINIMAX_CALLS = ("<minimax:tool_call>", "</minimax:tool_call>")

# format -> (the marker that opens a call, the one that closes it)
TOOL_CALL_MARKERS = {"hermes": ("<tool_call>", "</tool_call>"),
                     "glm45": ("<tool_call>", "</tool_call>"),
                     "qwen3_xml": ("<tool_call>", "</tool_call>"),
                     "deepseek_v3": DS_CALL, "deepseek_v31": DS_CALL, "kimi_k2": KIMI_CALL,
                     "minimax_m2": ('<invoke name="', "</invoke>")}
# every syntax a template may teach (harmony's calls are messages, not marked blocks)
TOOL_CALL_SYNTAXES = frozenset({*TOOL_CALL_MARKERS, "harmony"})
# format -> (the marker before a turn's calls, the one after them): not text of the answer
SECTION_MARKERS = {"deepseek_v3": DS_CALLS, "deepseek_v31": DS_CALLS, "kimi_k2": KIMI_CALLS,
                   "minimax_m2": MINIMAX_CALLS}
# glm45's key/value tags
ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = ("<arg_key>", "</arg_key>", "<arg_value>",
                                                  "</arg_value>")
# formats whose chat answers are channeled messages (reasoning, answer, calls) marked by
# special tokens: the engine keeps those in the text of a chat request, the gateway splits it
CHANNELED = frozenset({"harmony"})
# formats whose markers may be special tokens: kept in the text of a chat request with tools
KEEPS_SPECIAL = CHANNELED | {"deepseek_v3", "deepseek_v31", "kimi_k2"}
# formats whose chat template iterates a call's arguments (`arguments.items()`): the history's
# calls reach it with their arguments as an object, not as JSON text
ARGUMENTS_AS_OBJECT = frozenset({"glm45", "qwen3_xml", "minimax_m2"})


def template_tool_call_format(chat_template: str | None) -> str:
    """The syntax a chat template teaches its model; "" when none Strata parses. GLM's and
    Qwen3.5's templates open calls with <tool_call> too: their argument tags tell them apart;
    DeepSeek-V3's wraps the arguments in a ```json fence, V3.1's does not."""
    if not chat_template:
        return ""
    if "<|channel|>" in chat_template:
        return "harmony"
    if KIMI_CALL[0] in chat_template:
        return "kimi_k2"
    if MINIMAX_CALLS[0] in chat_template:
        return "minimax_m2"
    if DS_CALL[0] in chat_template:
        return "deepseek_v3" if "```json" in chat_template else "deepseek_v31"
    if "<tool_call>" not in chat_template:
        return ""
    if "<function=" in chat_template:
        return "qwen3_xml"
    return "glm45" if ARG_KEY in chat_template else "hermes"
