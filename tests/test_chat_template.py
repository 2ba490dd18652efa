"""Chat templates render as transformers renders them, inside a sandbox, with TemplateError on failure."""
from __future__ import annotations

from datetime import datetime

import pytest

from imp_jax.errors import TemplateError
from imp_jax.model.text.chat_template import compile_template, render_chat_template

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
# A tool-calling template in the style of Qwen/Hermes: tojson, loop controls, namespace, whitespace control.
TOOLS_TEMPLATE = """{%- if tools %}
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
{%- endif %}
{%- set ns = namespace(n=0) %}
{%- for message in messages %}
    {%- if message.role == 'stop' %}{% break %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
<|{{ message.role }}|>{{ message.content }}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}
<call>{{ call.function | tojson(indent=2) }}</call>
        {%- endfor %}
    {%- endif %}
{%- endfor %}
{%- if documents %}{% for d in documents %}
[{{ d.title }}] {{ d.text }}{% endfor %}{% endif %}
count={{ ns.n }}
{%- if add_generation_prompt %}
<|assistant|>
{%- endif %}
"""
USER = [{"role": "user", "content": "Hi there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für <Ort> 🌦",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    USER,
    [{"role": "system", "content": "Be brief."}, *USER, {"role": "assistant", "content": "Hello!"}],
    [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
     {"role": "stop", "content": "ignored"}, {"role": "user", "content": "never shown"}],
]


def test_smollm2_chatml_default_system_prompt() -> None:
    out = render_chat_template(SMOLLM2, USER)
    assert out == SMOLLM2_SYSTEM + "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert not render_chat_template(SMOLLM2, USER, add_generation_prompt=False).endswith("assistant\n")


def test_smollm2_chatml_own_system_prompt() -> None:
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    assert render_chat_template(SMOLLM2, messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n")


def test_tools_documents_tojson_and_loop_controls() -> None:
    out = render_chat_template(TOOLS_TEMPLATE, CONVERSATIONS[2], tools=TOOLS,
                               documents=[{"title": "Doc", "text": "Zürich is in Switzerland."}])
    assert '"description": "Wetter für <Ort> 🌦"' in out  # tojson: no ASCII or HTML escaping
    assert '<call>{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Zürich"\n  }\n}</call>' in out
    assert "never shown" not in out and "count=2" in out  # {% break %} stopped the loop
    assert "[Doc] Zürich is in Switzerland." in out and out.endswith("<|assistant|>")
    assert "None" not in out  # content=None is dropped, as HF does, so the template sees it undefined


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("template", [SMOLLM2, TOOLS_TEMPLATE], ids=["smollm2", "tools"])
def test_matches_transformers(template: str, conversation: int) -> None:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    messages = CONVERSATIONS[conversation]
    if template is SMOLLM2 and any(m["content"] is None for m in messages):
        pytest.skip("SmolLM2's template concatenates content, so it needs text")
    for add_generation_prompt in (True, False):
        ours = render_chat_template(template, messages, tools=TOOLS, add_generation_prompt=add_generation_prompt,
                                    variables={"bos_token": "<s>"})
        # transformers' apply_chat_template drops None-valued keys before this lower-level render
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        theirs, _ = utils.render_jinja_template(conversations=[plain], tools=TOOLS, chat_template=template,
                                                add_generation_prompt=add_generation_prompt, bos_token="<s>")
        assert ours == theirs[0]


@pytest.mark.parametrize("final", ["Sure, here", "Sure, ", "  padded  "])
def test_continue_final_message_matches_transformers(final: str) -> None:
    messages = [*USER, {"role": "assistant", "content": final}]
    ours = render_chat_template(SMOLLM2, messages, add_generation_prompt=False, continue_final_message=True)
    assert ours.endswith("<|im_start|>assistant\n" + final)
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    theirs, _ = utils.render_jinja_template(conversations=[messages], chat_template=SMOLLM2,
                                            continue_final_message=True)
    assert ours == theirs[0]


def test_continue_final_message_with_trimmed_content() -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}"
    messages = [*USER, {"role": "assistant", "content": "Partial answer  "}]
    out = render_chat_template(template, messages, add_generation_prompt=False, continue_final_message=True)
    assert out == "[user] Hi there\n[assistant] Partial answer"


def test_continue_final_message_with_content_parts() -> None:
    template = "{% for m in messages %}{% for p in m.content %}{{ p.text }}|{% endfor %}{% endfor %}"
    messages = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat_template(template, messages, add_generation_prompt=False,
                                continue_final_message=True) == "a|b"
    assert messages[0]["content"][1]["text"] == "b"  # the caller's messages are never modified


def test_continue_final_message_errors() -> None:
    with pytest.raises(TemplateError, match="cannot both"):
        render_chat_template(SMOLLM2, [*USER, {"role": "assistant", "content": "x"}], continue_final_message=True)
    with pytest.raises(TemplateError, match="assistant"):
        render_chat_template(SMOLLM2, USER, add_generation_prompt=False, continue_final_message=True)
    dropping = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(TemplateError, match="final message"):
        render_chat_template(dropping, [*USER, {"role": "assistant", "content": "x"}], add_generation_prompt=False,
                             continue_final_message=True)


def test_raise_exception_message_reaches_the_client() -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}"
    with pytest.raises(TemplateError, match="^Conversation must start with user$") as info:
        render_chat_template(template, [{"role": "assistant", "content": "x"}])
    assert info.value.status == 400


def test_strftime_now() -> None:
    assert render_chat_template("{{ strftime_now('%Y') }}", USER) == str(datetime.now().year)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set ns = namespace(_hidden=1) %}",
    "{% set xs = [] %}{{ xs.append(1) }}",
    "{{ cycler.__init__.__globals__.os }}",
])
def test_sandbox_blocks_escapes(template: str) -> None:
    with pytest.raises(TemplateError):
        render_chat_template(template, USER)


@pytest.mark.parametrize("template", [
    "{% for m in messages %}",  # syntax error
    "{{ missing.attribute }}",  # undefined
    "{{ messages[0].content + 1 }}",  # a Python TypeError inside the template
])
def test_jinja_failures_are_template_errors(template: str) -> None:
    with pytest.raises(TemplateError, match="chat template error"):
        render_chat_template(template, USER)


def test_bad_inputs_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="no chat template"):
        render_chat_template(None, USER)
    with pytest.raises(TemplateError, match="empty"):
        render_chat_template(SMOLLM2, [])
    with pytest.raises(TemplateError, match="object"):
        render_chat_template(SMOLLM2, ["not a message"])  # type: ignore[list-item]
    with pytest.raises(TemplateError, match="tools"):
        render_chat_template(SMOLLM2, USER, tools=["f"])  # type: ignore[list-item]


def test_undefined_variable_renders_empty_and_generation_block_is_accepted() -> None:
    template = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{{ nothing }}{% endfor %}"
    assert render_chat_template(template, USER) == "Hi there"


def test_reasoning_is_aliased_to_reasoning_content() -> None:
    template = "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }}{% endfor %}"
    messages = [{"role": "assistant", "content": "x", "reasoning": "hmm"}]
    assert render_chat_template(template, messages, add_generation_prompt=False) == "hmm/hmm"


def test_templates_are_compiled_once() -> None:
    assert compile_template(SMOLLM2) is compile_template(SMOLLM2)
