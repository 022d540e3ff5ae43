"""Render tool-use conversations with the model's own chat template into role-tagged token ids.

How roles are found: every message content is replaced by a unique sentinel, the conversation is
rendered once with `tokenizer.apply_chat_template(..., tools=...)`, and the text is split around the
sentinels. The pieces between sentinels are template scaffolding (CONTEXT); the sentinels are the
contents (assistant -> ACT, tool -> REHEARSE or OBSERVED, system/user -> CONTEXT). A second render
with the real contents checks that the template inserted the contents verbatim (or stripped, as
Llama-3.1 does with `| trim`); anything else raises, so a role can never silently cover template text.

Tokenization boundary (a deliberate choice): scaffolding pieces and contents are tokenized
*separately* and concatenated. Content tokens are then exactly `tokenize(content)`, which is also what
the rollout engine produces: the model samples content tokens after forced scaffolding tokens, and
scaffolding is forced after the content, so no BPE merge ever crosses a role boundary. The result may
differ from tokenizing the whole rendered string at a few boundaries (e.g. "\\n" + "\\n..." ->
"\\n\\n"); decoding gives the same text.

Tool-call protocol (fixed by fastrehearse, independent of the template): an assistant turn's text
contains its calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (several
blocks = parallel calls). Assistant messages given with structured `tool_calls` are rendered by
appending those blocks to the content, so ACT tokens are exactly what the model would generate.

Templates without tool support (SmolLM2's ships none: it ignores `tools` and `tool` turns would be
rendered as a role named "tool") get `DEFAULT_TOOL_CHATML`, a ChatML template with the structure of
Qwen2.5's tool template (tools in the system turn, tool responses as `<tool_response>` blocks in a
user turn). Such templates are detected by `template_supports_tools`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from fastrehearse.kernels.roles import Role

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# Qwen2.5-style tool-aware ChatML. `default_system` is used when the conversation has no system turn.
DEFAULT_TOOL_CHATML = (
    "{%- set default_system = default_system | default('You are a helpful assistant.') %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system_text = messages[0]['content'] %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system_text = default_system %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system_text }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- if message.get('tool_calls') %}{%- for tc in message['tool_calls'] %}"
    "{%- set f = tc['function'] if tc.get('function') else tc %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson) "
    "+ '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SENTINEL = "\ue000FR{}\ue001"  # private-use code points: never produced by a tokenizer's text
_SENTINEL_RE = re.compile("\ue000FR(\\d+)\ue001")
_TAG_RE = re.compile(r"<[^<>\s]+>")


def format_tool_call(name: str, arguments: Any) -> str:
    """One call in the fastrehearse protocol (what the policy is expected to emit)."""
    return (f"{TOOL_CALL_OPEN}\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
            + f"\n{TOOL_CALL_CLOSE}")


def assistant_text(message: dict) -> str:
    """The full text of an assistant turn: content followed by its tool-call blocks."""
    text = message.get("content") or ""
    for tc in message.get("tool_calls") or []:
        f = tc.get("function", tc)
        args = f.get("arguments", {})
        if isinstance(args, str):  # OpenAI sends arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        text += ("\n" if text else "") + format_tool_call(f["name"], args)
    return text


def _content_variants(c: str) -> list[str]:
    """How templates insert a content: verbatim, `| trim`med (Llama-3.1), or JSON-escaped (Llama-3.1
    applies `tojson` to tool contents, since a Jinja string is `iterable`)."""
    out = [c, c.strip()]
    out.append(json.dumps(c, ensure_ascii=False)[1:-1])
    out.append(json.dumps(c)[1:-1])
    return list(dict.fromkeys(out))


def _match_contents(scaffolds: list[str], contents: list[str], real: str) -> list[str]:
    """Find, left to right, the form in which the template inserted each content into `real`.
    Raises when the template transforms a content in any other way (roles would be wrong)."""
    pos, found = 0, []
    for k, scaffold in enumerate(scaffolds):
        if not real.startswith(scaffold, pos):
            raise ValueError("the chat template renders differently with sentinel contents; "
                             "fastrehearse cannot tag roles for it")
        pos += len(scaffold)
        if k == len(contents):
            break
        nxt = scaffolds[k + 1]
        for v in _content_variants(contents[k]):
            if real.startswith(v, pos) and real.startswith(nxt, pos + len(v)):
                found.append(v)
                pos += len(v)
                break
        else:
            raise ValueError(f"the chat template transforms the content of message {k} (beyond "
                             "strip / JSON escaping); role tagging needs contents inserted verbatim")
    if pos != len(real):
        raise ValueError("the chat template rendered trailing text that depends on contents")
    return found


def template_supports_tools(template: str | None) -> bool:
    """A template supports tool use when it renders tool schemas and tool turns."""
    return bool(template) and "tools" in template and ("tool" in template.replace("tools", ""))


@dataclass
class Rendered:
    input_ids: list[int]
    roles: list[int]
    text: str
    # (token_start, token_end, role, message_index or -1 for scaffolding)
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    span_texts: list[str] = field(default_factory=list)   # the text of each span


@dataclass
class Scaffolding:
    """Token sequences the rollout engine forces to switch turns inline (all role CONTEXT)."""
    generation_prompt: list[int]     # opens an assistant turn after a user turn
    assistant_to_tool: list[int]     # closes an assistant turn after its calls, opens the tool turn
    tool_to_tool: list[int]          # between two tool responses of one parallel-call turn
    tool_to_assistant: list[int]     # closes the tool turn, reopens the assistant turn
    assistant_end: list[int]         # closes a final assistant turn
    texts: dict[str, str] = field(default_factory=dict)


class ChatTemplate:
    """Role-tagged rendering with a tokenizer's chat template (or `DEFAULT_TOOL_CHATML`)."""

    def __init__(self, tokenizer, template: str | None = None, *, default_system: str | None = None):
        self.tokenizer = tokenizer
        own = template if template is not None else getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):  # tokenizers may ship named templates
            own = own.get("tool_use") or own.get("default")
        self.uses_default_template = not template_supports_tools(own)
        self.template = DEFAULT_TOOL_CHATML if self.uses_default_template else own
        self._template_kwargs = {}
        if default_system is not None:
            self._template_kwargs["default_system"] = default_system
        self.scaffolding = self._build_scaffolding()
        self.assistant_end_markers, self.tool_end_markers = self._build_markers()

    # -- rendering ------------------------------------------------------------------------------
    def render_text(self, messages: list[dict], tools: list[dict] | None = None, *,
                    add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, chat_template=self.template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **self._template_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def render(self, messages: list[dict], tools: list[dict] | None = None, *,
               tool_roles: Role | Sequence[Role] = Role.REHEARSE,
               add_generation_prompt: bool = False) -> Rendered:
        """Token ids + one role per token. `tool_roles`: one role for all tool turns, or one per
        tool turn in order (REHEARSE for rehearsed responses, OBSERVED for executed ones)."""
        scaffolds, contents, roles, real = self._pieces(messages, tools, tool_roles, add_generation_prompt)
        ids: list[int] = []
        out_roles: list[int] = []
        spans, span_texts = [], []
        for k, scaffold in enumerate(scaffolds):
            for text, role, mi in ((scaffold, Role.CONTEXT, -1),
                                   *(((contents[k], roles[k], k),) if k < len(contents) else ())):
                toks = self.encode(text)
                spans.append((len(ids), len(ids) + len(toks), int(role), mi))
                span_texts.append(text)
                ids += toks
                out_roles += [int(role)] * len(toks)
        return Rendered(ids, out_roles, real, spans, span_texts)

    def _pieces(self, messages, tools, tool_roles, add_generation_prompt):
        """(scaffolding texts, contents as inserted, content roles, rendered text): scaffolds[k]
        precedes contents[k]; the last scaffold follows the last content."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of chat messages")
        contents, roles = [], []
        n_tool = 0
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be a dict with a 'role' key, got {m!r}")
            r = m["role"]
            if r == "assistant":
                contents.append(assistant_text(m))
                roles.append(Role.ACT)
            elif r == "tool":
                if isinstance(tool_roles, (list, tuple)):
                    if n_tool >= len(tool_roles):
                        raise ValueError(f"tool_roles has {len(tool_roles)} entries but messages "
                                         f"has more tool turns")
                    tr = Role(tool_roles[n_tool])
                else:
                    tr = Role(tool_roles)
                if tr not in (Role.REHEARSE, Role.OBSERVED):
                    raise ValueError(f"tool_roles must be REHEARSE or OBSERVED, got {tr!r}")
                n_tool += 1
                c = m.get("content")
                contents.append(c if isinstance(c, str) else json.dumps(c, ensure_ascii=False))
                roles.append(tr)
            elif r in ("system", "user"):
                c = m.get("content")
                if not isinstance(c, str):
                    raise ValueError(f"messages[{i}] ({r}) content must be a string")
                contents.append(c)
                roles.append(Role.CONTEXT)
            else:
                raise ValueError(f"messages[{i}] has unknown role {r!r}")

        def with_contents(cs):
            return [{"role": m["role"], "content": c} for m, c in zip(messages, cs)]

        sent = self.render_text(with_contents([_SENTINEL.format(i) for i in range(len(contents))]),
                                tools, add_generation_prompt=add_generation_prompt)
        pieces = _SENTINEL_RE.split(sent)  # [scaffold, idx, scaffold, idx, ..., scaffold]
        order = [int(x) for x in pieces[1::2]]
        if sorted(order) != list(range(len(contents))) or order != sorted(order):
            raise ValueError("the chat template dropped, duplicated or reordered message contents; "
                             "fastrehearse cannot tag roles for it")
        real = self.render_text(with_contents(contents), tools,
                                add_generation_prompt=add_generation_prompt)
        return pieces[::2], _match_contents(pieces[::2], contents, real), roles, real

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> Rendered:
        """The initial prompt of an episode: everything CONTEXT, ending with the generation prompt."""
        r = self.render(messages, tools, add_generation_prompt=True)
        r.roles = [int(Role.CONTEXT)] * len(r.input_ids)
        return r

    def continuation(self, messages: list[dict], tools: list[dict] | None = None,
                     marker: str | None = None) -> list[int]:
        """Tokens that follow a final assistant turn (already in the sequence, ended by `marker`)
        to add `messages` (user / system turns, CONTEXT) and open the next assistant turn, exactly
        as the template renders them after an assistant reply. `tools` are the tools visible now:
        templates that place tools near the latest turn render them here; ChatML-style templates
        keep tools in the system turn, which an episode never re-renders (token in, token out)."""
        probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                 {"role": "assistant", "content": "A"}]
        if not messages or any(m.get("role") not in ("user", "system") for m in messages):
            raise ValueError("continuation() takes user / system messages only")
        scaffolds, contents, _, _ = self._pieces(probe + list(messages), tools, Role.REHEARSE, True)
        joint = scaffolds[len(probe)]       # scaffolding between the reply and the first new message
        head = joint[joint.index(marker) + len(marker):] if marker and marker in joint else joint
        ids = self.encode(head)
        for k in range(len(probe), len(contents)):   # tokenized piece by piece, as render() does
            ids += self.encode(contents[k]) + self.encode(scaffolds[k + 1])
        return ids

    # -- scaffolding for inline turn switching ------------------------------------------------
    def _build_scaffolding(self) -> Scaffolding:
        probe = [
            {"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}, {"role": "tool", "content": "T"},
            {"role": "tool", "content": "T"}, {"role": "assistant", "content": "B"},
        ]
        tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                                    "parameters": {"type": "object", "properties": {}}}}]
        sent = [{"role": m["role"], "content": _SENTINEL.format(i)} for i, m in enumerate(probe)]
        text = self.render_text(sent, tools)
        pieces = _SENTINEL_RE.split(text)[::2]  # scaffold before msg 0, between 0-1, ..., after 5
        gen_prefix = self.render_text(sent[:2], tools)
        gen_full = self.render_text(sent[:2], tools, add_generation_prompt=True)
        if not gen_full.startswith(gen_prefix):
            raise ValueError("the chat template's generation prompt is not a suffix of the prompt")
        texts = {
            "generation_prompt": gen_full[len(gen_prefix):],
            "assistant_to_tool": pieces[3],
            "tool_to_tool": pieces[4],
            "tool_to_assistant": pieces[5],
            "assistant_end": pieces[6],
        }
        if not texts["generation_prompt"]:
            raise ValueError("the chat template has no generation prompt (add_generation_prompt "
                             "renders nothing)")
        return Scaffolding(**{k: self.encode(v) for k, v in texts.items()}, texts=texts)

    def _build_markers(self) -> tuple[list[str], list[str]]:
        """Strings that end a generated turn: the assistant's end-of-turn marker (the first tag of
        the final-turn scaffolding, e.g. <|im_end|> / <|eot_id|>) plus the tokenizer's EOS; for
        a rehearsed tool response, the first tag of the tool-close scaffolding (e.g.
        </tool_response>) plus the assistant markers."""
        t = self.scaffolding.texts
        first = _TAG_RE.search(t["assistant_end"]) or _TAG_RE.search(t["assistant_to_tool"])
        if first is None:
            raise ValueError("cannot find an end-of-turn marker in the chat template")
        assistant = [first.group(0)]
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos and eos not in assistant:
            assistant.append(eos)
        tool_first = _TAG_RE.search(t["tool_to_assistant"])
        tool = [tool_first.group(0)] if tool_first else []
        tool += [m for m in assistant if m not in tool]
        return assistant, tool

    def tool_content_from_generated(self, text: str, marker: str | None) -> str:
        """The response content of a rehearsed tool turn from its generated text: drop the end
        marker and the scaffolding the template puts before it (Qwen: "\\n" before
        </tool_response>; Llama-3.1: the closing quote of its tojson), and undo the JSON-escaping of
        templates that quote tool contents."""
        if marker and text.endswith(marker):
            text = text[:-len(marker)]
        close = self.scaffolding.texts["tool_to_assistant"]
        pre = close[:close.index(marker)] if marker and marker in close else ""
        if pre and text.endswith(pre):
            text = text[:-len(pre)]
        if self.scaffolding.texts["assistant_to_tool"].endswith('"') and pre.startswith('"'):
            try:
                text = json.loads('"' + text + '"')
            except ValueError:
                pass
        return text.strip()

    def remainder(self, scaffold: str, marker: str | None) -> list[int]:
        """Tokens to force after a generated `marker` to complete scaffolding `scaffold` (a key of
        `scaffolding.texts`). The part of the scaffolding the model already wrote (up to and
        including the marker) is not repeated; a marker the scaffolding lacks forces it whole."""
        text = self.scaffolding.texts[scaffold]
        if marker and marker in text:
            return self.encode(text[text.index(marker) + len(marker):])
        return list(getattr(self.scaffolding, scaffold))
