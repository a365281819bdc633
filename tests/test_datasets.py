import json

import pytest

from pipeline.chat import prompt_ids, prompt_ids_batch, tokenize_conversation
from pipeline.datasets import LoadReport, load_conversations, near_duplicates, normalize, recover_json_array
from pipeline.manifest import StepError


def test_truncated_array_keeps_complete_records():
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]} for i in range(3)]
    text = json.dumps(recs)
    cut = text[: text.rindex('"value": "a"') + 5]  # cut inside the last record
    got, skipped = recover_json_array(cut, "x.json")
    assert [r["id"] for r in got] == ["0", "1"]
    assert skipped > 0
    assert recover_json_array(text, "x.json") == (recs, 0)


def test_malformed_middle_is_an_error_naming_the_file():
    text = '[{"id": "a", "conversations": []}, {"id": "b", "conversations": [}]'
    with pytest.raises(StepError, match="bad.json: malformed JSON"):
        recover_json_array(text, "bad.json")


def test_not_an_array(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"id": 1}')
    with pytest.raises(StepError, match="expected a JSON array"):
        load_conversations("vllm-0.32", str(p))


def test_malformed_jsonl_names_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"conversations": []}\n{oops\n')
    with pytest.raises(StepError, match=r"c.jsonl:2"):
        load_conversations("vllm-0.32", str(p))


def test_jsonl_with_a_unicode_line_separator_inside_a_string(tmp_path):
    """JSON writers that keep non-ASCII (ensure_ascii=False) leave U+2028/U+2029 raw inside strings; a JSONL record
    ends at "\n" only (str.splitlines also splits there, which broke a 16k-conversation file at its line 56)."""
    p = tmp_path / "c.jsonl"
    rec = {"messages": [{"role": "user", "content": "a\u2028b"}, {"role": "assistant", "content": "c\u2029d"}]}
    p.write_text(json.dumps(rec, ensure_ascii=False) + "\n", encoding="utf-8")
    convs, _ = load_conversations("vllm-0.32", str(p))
    assert [m["content"] for m in convs[0]["messages"]] == ["a\u2028b", "c\u2029d"]


def test_normalize_roles_merge_and_drop():
    rep = LoadReport("x")
    c = normalize({"id": "1", "conversations": [
        {"from": "gpt", "value": "continuation"},
        {"from": "human", "value": "Q1"}, {"from": "user", "value": "more"},
        {"from": "chatgpt", "value": "A1"}, {"from": "human", "value": "dangling"}]}, rep)
    assert c["messages"] == [{"role": "user", "content": "Q1\n\nmore"}, {"role": "assistant", "content": "A1"}]
    assert normalize({"conversations": []}, rep) is None
    assert normalize({"conversations": [{"from": "alien", "value": "x"}]}, rep) is None
    assert rep.dropped == {"empty conversation": 1, "unknown role": 1}


def test_packaged_sharegpt_is_recovered():
    convs, rep = load_conversations("vllm-0.32")
    assert rep.records_recovered == 17671  # every complete record before the cut
    assert rep.bytes_skipped_at_end > 0
    assert len(convs) == rep.kept > 15000
    assert len({c["id"] for c in convs}) == len(convs)


def test_near_duplicate_detection():
    q = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and must-see attractions."
    convs = [
        {"id": "copy", "messages": [{"role": "user", "content": "Please: " + q.lower()}, {"role": "assistant", "content": "x"}]},
        {"id": "other", "messages": [{"role": "user", "content": "Write a poem about the sea and the sky at dawn."}, {"role": "assistant", "content": "x"}]},
    ]
    assert near_duplicates(convs, [q]) == {"copy"}


def test_batched_prompt_ids_equal_one_by_one(smollm2):
    """prepare's rounds key their answers by prompt token ids, so the batched form must give exactly the ids of
    prompt_ids: checked on the packaged ShareGPT's multi-turn prompts (system turns, long histories, non-ASCII)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    convs, _ = load_conversations("vllm-0.32")
    prompts = []
    for c in convs[:150]:
        msgs = [m for m in c["messages"] if m["role"] in ("system", "user", "assistant")]
        prompts += [msgs[: i + 1] for i, m in enumerate(msgs) if m["role"] == "user"]
    assert len(prompts) > 300 and max(len(p) for p in prompts) > 9
    assert prompt_ids_batch(tok, prompts) == [prompt_ids(tok, p) for p in prompts]
    assert prompt_ids_batch(tok, []) == []


def test_loss_mask_covers_exactly_the_assistant_turns(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]
    t = tokenize_conversation(tok, msgs, 1024)
    masked = tok.decode([i for i, m in zip(t.input_ids, t.loss_mask) if m])
    assert masked == "Hello!<|im_end|>\nGoodbye.<|im_end|>\n"
    assert tok.decode(t.input_ids) == tok.apply_chat_template(msgs, tokenize=False)
    short = tokenize_conversation(tok, msgs, 10)
    assert len(short.input_ids) == 10 and sum(short.loss_mask) == 0


def test_agentic_records_reach_the_chat_template_intact(tmp_path):
    """An OpenAI-style agentic record in a JSONL file (content null beside tool_calls, arguments as an object,
    a tool result, reasoning_content, a tools list) loads as exactly the conversation the Kimi golden test
    renders, so prepare masks it the same way: tool calls trained, tool results not. Broken agentic records
    are dropped with a reason."""
    from tests.kimi_toy import fast_kimi_tokenizer
    from tests.test_kimi_format import CONV, EXPECTED, TOOLS, masked_runs

    raw = json.loads(json.dumps(CONV))
    raw[2]["content"] = None
    raw[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    good = {"id": "agent-1", "messages": raw, "tools": TOOLS}
    no_call = {"id": "bad-1", "messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "18C"},
                                           {"role": "assistant", "content": "a"}]}
    bad_call = {"id": "bad-2", "messages": [{"role": "user", "content": "q"},
                                            {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]}
    bad_tools = {"id": "bad-3", "messages": CONV[1:3], "tools": "get_weather"}
    ends_on_result = {"id": "agent-2", "messages": CONV[1:4]}  # the result has no answer yet: trimmed to the call
    exported = {"id": "plain-1", "tools": json.dumps(TOOLS), "messages": [  # tools as JSON text, [] on plain turns
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "tool_calls": []}]}
    p = tmp_path / "agentic.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in (good, no_call, bad_call, bad_tools, ends_on_result, exported)) + "\n")

    convs, rep = load_conversations("vllm-0.32", str(p))
    assert rep.dropped == {"tool result without a tool call before it": 1, "malformed tool_calls": 1,
                           "malformed tools list": 1}
    assert [c["id"] for c in convs] == ["agent-1", "agent-2", "plain-1"]
    assert convs[0]["messages"] == CONV and convs[0]["tools"] == TOOLS
    assert convs[1]["messages"] == CONV[1:3] and "tools" not in convs[1]
    assert convs[2]["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert convs[2]["tools"] == TOOLS
    tok = fast_kimi_tokenizer()
    t = tokenize_conversation(tok, convs[0]["messages"], 4096, tools=convs[0]["tools"], reasoning="keep")
    assert tok.decode(t.input_ids) == EXPECTED["keep"][0] and masked_runs(tok, t) == EXPECTED["keep"][1]
