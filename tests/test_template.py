"""Role-tagged chat-template rendering (fastrehearse.rollout.text.template).

Templates: the real SmolLM2 tokenizer's own template (no tool support -> fastrehearse's default
tool-aware ChatML), and test replicas of the Qwen2.5 and Llama-3.1 template structures
(tests/_rollout_fixtures.py; the real Qwen/Llama templates are not available offline).
"""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastrehearse.kernels.roles import Role
from fastrehearse.rollout.text.template import ChatTemplate, assistant_text, template_supports_tools
from _rollout_fixtures import (CALC_TOOLS, LLAMA31_TEMPLATE, QWEN25_TEMPLATE,
                                          llama3_style_tokenizer, smollm2_tokenizer)


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module", params=["smollm2", "qwen25", "llama31"])
def tmpl(request, tok):
    if request.param == "smollm2":
        return ChatTemplate(tok)
    if request.param == "qwen25":
        return ChatTemplate(tok, QWEN25_TEMPLATE)
    return ChatTemplate(llama3_style_tokenizer())


def conversation():
    return [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "What is 2 + 3? Then look up 'x'."},
        {"role": "assistant", "content": "Let me compute.",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
                        {"type": "function", "function": {"name": "lookup", "arguments": {"key": "x"}}}]},
        {"role": "tool", "content": '{"result": 5}'},
        {"role": "tool", "content": '{"key": "x", "value": 7}'},
        {"role": "assistant", "content": "2 + 3 = 5 and x is 7."},
    ]


def expected_forms(content):
    """Content forms a template may insert: verbatim, stripped, JSON-escaped (Llama-3.1 tool turns)."""
    return {content, content.strip(), json.dumps(content)[1:-1], json.dumps(content, ensure_ascii=False)[1:-1]}


def check_roles(ct, msgs, rendered, tool_roles):
    t = ct.tokenizer
    assert len(rendered.input_ids) == len(rendered.roles)
    # Decoding everything gives the template's own text: nothing dropped or duplicated.
    assert t.decode(rendered.input_ids) == rendered.text
    assert rendered.text == ct.render_text(
        [{"role": m["role"], "content": assistant_text(m) if m["role"] == "assistant" else m["content"]}
         for m in msgs], CALC_TOOLS)
    tool_iter = iter(tool_roles)
    seen = set()
    for start, end, role, mi in rendered.spans:
        assert all(r == role for r in rendered.roles[start:end])
        if mi < 0:
            assert role == Role.CONTEXT
            continue
        seen.add(mi)
        m = msgs[mi]
        text = t.decode(rendered.input_ids[start:end])
        if m["role"] == "assistant":
            assert role == Role.ACT
            assert text in expected_forms(assistant_text(m))
            # no scaffolding leaked into ACT (unless the content itself has "<|": hypothesis
            # generates such contents, and the check above already pins the text to the content)
            assert "<|" not in text or "<|" in assistant_text(m)
        elif m["role"] == "tool":
            assert role == next(tool_iter)
            assert text in expected_forms(m["content"])
        else:
            assert role == Role.CONTEXT
    assert seen == set(range(len(msgs)))
    # Per role, the concatenated decoded tokens are exactly the concatenated turn contents.
    for role in (Role.ACT, Role.REHEARSE, Role.OBSERVED):
        ids = [i for i, r in zip(rendered.input_ids, rendered.roles) if r == role]
        pieces = [t.decode(rendered.input_ids[s:e]) for s, e, r, _ in rendered.spans if r == role]
        assert t.decode(ids) == "".join(pieces)


def test_smollm2_template_has_no_tool_support(tok):
    assert not template_supports_tools(tok.chat_template)
    ct = ChatTemplate(tok)
    assert ct.uses_default_template
    assert ct.scaffolding.texts["assistant_to_tool"] == "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
    assert ct.scaffolding.texts["tool_to_assistant"] == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert ct.scaffolding.texts["generation_prompt"] == "<|im_start|>assistant\n"
    assert ct.assistant_end_markers[0] == "<|im_end|>"
    assert ct.tool_end_markers[0] == "</tool_response>"


def test_qwen_and_llama_replicas_keep_their_own_template(tok):
    q = ChatTemplate(tok, QWEN25_TEMPLATE)
    assert not q.uses_default_template
    assert q.scaffolding.texts["tool_to_tool"] == "\n</tool_response>\n<tool_response>\n"
    ll = ChatTemplate(llama3_style_tokenizer())
    assert ll.template == LLAMA31_TEMPLATE and not ll.uses_default_template
    # Llama-3.1 applies tojson to string tool contents: the quotes are scaffolding.
    assert ll.scaffolding.texts["assistant_to_tool"] == \
        '<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"'
    assert ll.scaffolding.texts["tool_to_assistant"] == \
        '"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
    assert ll.tool_content_from_generated('{\\"a\\": 1}"<|eot_id|>', "<|eot_id|>") == '{"a": 1}'
    assert q.tool_content_from_generated('{"a": 1}\n</tool_response>', "</tool_response>") == '{"a": 1}'
    assert ll.assistant_end_markers[0] == "<|eot_id|>" and ll.tool_end_markers[0] == "<|eot_id|>"


@pytest.mark.parametrize("tool_roles", [Role.REHEARSE, Role.OBSERVED, [Role.OBSERVED, Role.REHEARSE]])
def test_role_tags_match_turn_contents(tmpl, tool_roles):
    msgs = conversation()
    r = tmpl.render(msgs, CALC_TOOLS, tool_roles=tool_roles)
    per_tool = tool_roles if isinstance(tool_roles, list) else [tool_roles] * 2
    check_roles(tmpl, msgs, r, per_tool)
    assert Role.ACT in r.roles and Role.CONTEXT in r.roles


def test_inline_scaffolding_reproduces_the_template(tmpl):
    """What the rollout engine builds inline (prompt, sampled content, forced scaffolding) is token
    for token what the template renders for the finished conversation."""
    msgs = conversation()
    full = tmpl.render(msgs, CALC_TOOLS)
    prompt = tmpl.render_prompt(msgs[:2], CALC_TOOLS)
    assert all(r == Role.CONTEXT for r in prompt.roles)
    sc = tmpl.scaffolding
    contents = {mi: full.input_ids[s:e] for s, e, _, mi in full.spans if mi >= 0}
    inline = (prompt.input_ids + contents[2] + sc.assistant_to_tool + contents[3] + sc.tool_to_tool
              + contents[4] + sc.tool_to_assistant + contents[5] + sc.assistant_end)
    assert inline == full.input_ids


def test_remainder_after_generated_marker(tok):
    ct = ChatTemplate(tok)
    # The model wrote "\n</tool_response>" itself: only the rest of the scaffolding is forced.
    assert tok.decode(ct.remainder("tool_to_assistant", "</tool_response>")) == \
        "<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ct.remainder("assistant_to_tool", "<|im_end|>")) == "\n<|im_start|>user\n<tool_response>\n"
    assert ct.remainder("assistant_to_tool", None) == ct.scaffolding.assistant_to_tool


_text = st.text(alphabet=st.sampled_from(list("ab xyz{}\":,\n\t.é中0123456789<>/_|")), max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(user=_text, act=_text, tool=_text, final=_text)
def test_random_contents_roundtrip(tok, user, act, tool, final):
    for ct in (ChatTemplate(tok, QWEN25_TEMPLATE), ChatTemplate(llama3_style_tokenizer())):
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": act},
                {"role": "tool", "content": tool}, {"role": "assistant", "content": final}]
        r = ct.render(msgs, CALC_TOOLS, tool_roles=Role.OBSERVED)
        check_roles(ct, msgs, r, [Role.OBSERVED])


def test_bad_inputs_raise(tok):
    ct = ChatTemplate(tok)
    with pytest.raises(ValueError, match="messages"):
        ct.render([])
    with pytest.raises(ValueError, match="unknown role"):
        ct.render([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="tool_roles"):
        ct.render([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], tool_roles=Role.ACT)
    with pytest.raises(ValueError, match="tool_roles"):
        ct.render([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], tool_roles=[])
    with pytest.raises(ValueError, match="transforms"):
        ChatTemplate(tok, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}"
                          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                          "{% endif %}{# tools tool #}").render([{"role": "user", "content": "abc"}])
