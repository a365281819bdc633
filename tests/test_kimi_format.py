"""Kimi-K2-style chat format: exact renderings and assistant-only loss masks, with tools and reasoning.

Tokenizers are built locally (tests/kimi_toy.py): one token per byte plus Kimi's special tokens, so
the expected token layouts below are exact. The slow tokenizer has no offsets (like Kimi's
tiktoken-based one) and goes through pipeline.chat._tokenize_by_segments."""
import pytest

from pipeline import chat
from pipeline.chat import TemplateError, tokenize_conversation
from tests.kimi_toy import SPECIALS, TEMPLATE, fast_kimi_tokenizer, slow_kimi_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOLS_JSON = '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]'
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C, sunny"},
    {"role": "assistant", "content": "<think>Report it.</think>It is 18C and sunny."},  # reasoning inline
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},  # no reasoning
]
CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')


def rendered(think1: str, think2: str) -> str:
    return (
        "<|im_system|>tool_declare<|im_middle|>" + TOOLS_JSON + "<|im_end|>"
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|><think>{think1}</think>" + CALL + "<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C, sunny<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|><think>{think2}</think>It is 18C and sunny.<|im_end|>"
        "<|im_user|>user<|im_middle|>Thanks<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>You're welcome.<|im_end|>"
    )


EXPECTED = {
    "keep": (rendered("Need the tool.", "Report it."), [
        "Need the tool.</think>" + CALL + "<|im_end|>",
        "Report it.</think>It is 18C and sunny.<|im_end|>",
        "</think>You're welcome.<|im_end|>",
    ]),
    "drop": (rendered("", ""), [
        "</think>" + CALL + "<|im_end|>",
        "</think>It is 18C and sunny.<|im_end|>",
        "</think>You're welcome.<|im_end|>",
    ]),
    "final_only": (rendered("Need the tool.", "Report it."), [
        CALL + "<|im_end|>",
        "It is 18C and sunny.<|im_end|>",
        "You're welcome.<|im_end|>",
    ]),
}

TOKENIZERS = {"fast": fast_kimi_tokenizer, "slow": slow_kimi_tokenizer}


def masked_runs(tok, t) -> list[str]:
    runs, cur = [], []
    for i, m in zip(t.input_ids, t.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur)), cur.clear()
    if cur:
        runs.append(tok.decode(cur))
    return runs


def pieces(*parts) -> list[tuple[str, int]]:
    """Expected token layout: special tokens are one token, other text one token per character."""
    out = []
    for text, m in parts:
        out += [(text, m)] if text in SPECIALS else [(c, m) for c in text]
    return out


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


def test_tokenizers_fast_and_slow():
    assert fast_kimi_tokenizer().is_fast and not slow_kimi_tokenizer().is_fast
    assert TEMPLATE.read_text().startswith("{#- Kimi-K2-style chat template")


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_golden_tools_and_reasoning(tok, mode):
    text, runs = EXPECTED[mode]
    t = tokenize_conversation(tok, CONV, 4096, tools=TOOLS, reasoning=mode)
    assert tok.decode(t.input_ids) == text
    assert masked_runs(tok, t) == runs
    # the input is not modified
    assert CONV[4]["content"].startswith("<think>") and CONV[2]["reasoning_content"] == "Need the tool."


def test_exact_token_layout(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reasoning_content": "ok"}]
    head = [("<|im_system|>", 0), ("system", 0), ("<|im_middle|>", 0),
            ("You are Kimi, an AI assistant created by Moonshot AI.", 0), ("<|im_end|>", 0),
            ("<|im_user|>", 0), ("user", 0), ("<|im_middle|>", 0), ("Hi", 0), ("<|im_end|>", 0),
            ("<|im_assistant|>", 0), ("assistant", 0), ("<|im_middle|>", 0), ("<think>", 0)]
    layouts = {
        "keep": pieces(*head, ("ok", 1), ("</think>", 1), ("Yo", 1), ("<|im_end|>", 1)),
        "final_only": pieces(*head, ("ok", 0), ("</think>", 0), ("Yo", 1), ("<|im_end|>", 1)),
        "drop": pieces(*head, ("</think>", 1), ("Yo", 1), ("<|im_end|>", 1)),
    }
    for mode, want in layouts.items():
        t = tokenize_conversation(tok, msgs, 4096, reasoning=mode)
        assert [(tok.decode([i]), m) for i, m in zip(t.input_ids, t.loss_mask)] == want, mode
        short = tokenize_conversation(tok, msgs, 20, reasoning=mode)
        assert short.input_ids == t.input_ids[:20] and short.loss_mask == t.loss_mask[:20]


def test_slow_tokenizer_goes_through_segments(monkeypatch):
    calls = []
    real = chat._tokenize_by_segments
    monkeypatch.setattr(chat, "_tokenize_by_segments", lambda *a: calls.append(1) or real(*a))
    slow, fast = slow_kimi_tokenizer(), fast_kimi_tokenizer()
    a = tokenize_conversation(slow, CONV, 4096, tools=TOOLS, reasoning="final_only")
    assert calls == [1]
    b = tokenize_conversation(fast, CONV, 4096, tools=TOOLS, reasoning="final_only")
    assert calls == [1]
    assert a.loss_mask == b.loss_mask and slow.decode(a.input_ids) == fast.decode(b.input_ids)


def test_segments_refuse_a_border_inside_a_merged_token():
    """A tokenizer that merges across a span border cannot be masked segment-wise: refused, not guessed."""
    tok = slow_kimi_tokenizer()
    orig = type(tok)._tokenize

    def merging(self, text, **kw):  # "ll" is one token ("l" id reused: only the count matters here)
        return [p for p in orig(self, text.replace("ll", "l"))]

    type(tok)._tokenize = merging
    try:
        with pytest.raises(TemplateError, match="segment-wise"):
            chat._tokenize_by_segments(tok, "Hello", [(3, 5)])  # border between the two l's
        ids, mask = chat._tokenize_by_segments(tok, "Hello", [(2, 5)])
        assert mask == [0, 0, 1, 1]
    finally:
        type(tok)._tokenize = orig


HISTORY = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B", "reasoning_content": "r1"},
           {"role": "user", "content": "C"}, {"role": "assistant", "content": "D", "reasoning_content": "r2"}]


def history_dropping_tokenizer():
    """A K2-Thinking-style template: reasoning rendered only after the last user message."""
    tok = fast_kimi_tokenizer()
    tok.chat_template = TEMPLATE.read_text().replace(
        "{{ message.get('reasoning_content') or '' }}",
        "{% if loop.index0 > (messages | map(attribute='role') | list | join(',')).split(',') | length - 3 %}"
        "{{ message.get('reasoning_content') or '' }}{% endif %}")
    return tok


def test_history_dropping_template_is_rejected_in_keep_mode():
    """K2-Thinking-style templates render reasoning only after the last user message: earlier turns
    change when the conversation grows, so keep/final_only cannot mask them; drop still works."""
    tok, msgs = history_dropping_tokenizer(), HISTORY
    assert "<think></think>B" in tok.apply_chat_template(msgs, tokenize=False)
    for mode in ("keep", "final_only"):
        with pytest.raises(TemplateError, match="prefix"):
            tokenize_conversation(tok, msgs, 4096, reasoning=mode)
    t = tokenize_conversation(tok, msgs, 4096, reasoning="drop")
    assert masked_runs(tok, t) == ["</think>B<|im_end|>", "</think>D<|im_end|>"]


def test_template_without_reasoning_field_gets_inline_think():
    """A ChatML template that ignores reasoning_content: reasoning goes back into content as <think>."""
    tok = fast_kimi_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_user|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|im_user|>assistant<|im_middle|>{% endif %}")
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    runs = {m: masked_runs(tok, tokenize_conversation(tok, msgs, 4096, reasoning=m)) for m in ("keep", "drop", "final_only")}
    assert runs == {"keep": ["<think>R</think>A<|im_end|>"], "drop": ["A<|im_end|>"], "final_only": ["A<|im_end|>"]}


def test_unknown_reasoning_mode():
    with pytest.raises(ValueError, match="reasoning mode"):
        tokenize_conversation(fast_kimi_tokenizer(), CONV[:3], 100, reasoning="sometimes")


def test_regenerated_answers_keep_their_reasoning():
    """prepare's regeneration: the engine's text drops special tokens (Kimi's think tags are special) and
    the thinking prompt already opened <think>; the stored answer is a whole <think>...</think> block."""
    from pipeline.engines.vllm_offline import Generation
    from pipeline.prepare import answer_text, prompt_opens_reasoning

    tok = fast_kimi_tokenizer()
    assert prompt_opens_reasoning(tok)
    ids = tok.encode("Plan.</think>Answer.", add_special_tokens=False) + [tok.eos_token_id]
    g = Generation(tok.decode(ids, skip_special_tokens=True), ids, "stop")
    assert g.text == "Plan.Answer."  # what vLLM's detokenizer returns
    content = answer_text(tok, g, True)
    assert content == "<think>Plan.</think>Answer."
    t = tokenize_conversation(tok, [{"role": "user", "content": "Q"}, {"role": "assistant", "content": content}], 4096,
                              reasoning="final_only")
    assert masked_runs(tok, t) == ["Answer.<|im_end|>"]
    cut = tok.encode("Plan and more", add_special_tokens=False)
    assert answer_text(tok, Generation("Plan and more", cut, "length"), True) is None
    # a non-thinking template: the engine's text, stripped (the previous behaviour)
    tok.chat_template = TEMPLATE.read_text().replace("<|im_middle|><think>\n", "<|im_middle|>\n")
    assert not prompt_opens_reasoning(tok)
    plain = tok.encode(" Just text ", add_special_tokens=False)
    assert answer_text(tok, Generation(" Just text ", plain, "stop"), False) == "Just text"


def test_conversations_tokenize_alike_on_worker_processes():
    """prepare tokenizes a large mix on worker processes (chat.tokenize_conversations): the same Tokenized, in the
    same order, and the same rejections, as one by one; with tools and reasoning, and a template that rejects."""
    tok, rejects = history_dropping_tokenizer(), HISTORY
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    items = [(CONV[1:], TOOLS), (rejects, None), (plain, None)] * 3 + [([dict(m, content=m["content"] + str(i))
                                                                         for m in plain], None) for i in range(5)]
    one = chat.tokenize_conversations(tok, items, 4096, workers=1)
    many = chat.tokenize_conversations(tok, items, 4096, workers=2)
    assert [isinstance(x, TemplateError) for x in one[:3]] == [True, True, False]  # reasoning in a dropped turn
    assert [(type(x), str(x)) if isinstance(x, TemplateError) else x for x in many] == \
           [(type(x), str(x)) if isinstance(x, TemplateError) else x for x in one]
    assert one[-1].input_ids != one[-2].input_ids  # each conversation's own result, in order
