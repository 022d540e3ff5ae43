"""Test fixtures for the rollout stage (not part of the package): the offline SmolLM2 tokenizer, test replicas of the Qwen2.5 and
Llama-3.1 chat-template structures (the real ones are not shipped offline), a tiny random Llama, and a
small fake tool environment.

The two templates below are written for fastrehearse's tests; they replicate the structure of the
published Qwen2.5 and Llama-3.1 tool templates (turn markers, where tools and tool responses go, the
Llama-3.1 `| trim` of contents and `tojson` of tool contents), not their full text.
"""
from __future__ import annotations

import functools
import json

from fastrehearse.envs.base import ResetResult, Task, ToolCall, ToolEnv, ToolResult, Trajectory

QWEN25_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools is not none %}
{%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
{{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}{{- "<|eot_id|>" }}
{%- elif message.role == "tool" or message.role == "ipython" %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}
{%- else %}{{- message.content }}{%- endif %}
{{- "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>"]


def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (fastrehearse.model.load_tokenizer: from the GGUF,
    memoized and cached on disk). Shared object: do not mutate it."""
    from fastrehearse.model.loader import load_tokenizer
    return load_tokenizer("smollm2")


@functools.lru_cache(maxsize=1)
def llama3_style_tokenizer():
    """SmolLM2's tokenizer plus Llama-3 special tokens (bos <|begin_of_text|>, eos <|eot_id|>), to
    exercise Llama-3-style templates offline."""
    import copy
    tok = copy.deepcopy(smollm2_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL})
    tok.bos_token = "<|begin_of_text|>"
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA31_TEMPLATE
    return tok


def tiny_llama(vocab_size: int, *, seed: int = 0, hidden: int = 32, layers: int = 2):
    """A tiny random LlamaForCausalLM in fp32 (eval mode, sdpa attention)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).float().eval()
    return model


CALC_TOOLS = [
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "Look up a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}},
]


class CalcEnv(ToolEnv):
    """A small deterministic ToolEnv for rollout tests (until the builtin suite lands): `add` and
    `lookup`; the task is solved when the final answer contains payload["answer"]."""

    def __init__(self):
        self.calls: list[ToolCall] = []

    def reset(self, task: Task) -> ResetResult:
        self.calls = []
        msgs = [{"role": "system", "content": "You are a calculator agent."},
                {"role": "user", "content": task.payload.get("question", "Add 2 and 3.")}]
        return ResetResult(tools=CALC_TOOLS, messages=msgs)

    def execute(self, call: ToolCall) -> ToolResult:
        self.calls.append(call)
        if call.name == "add":
            a, b = call.arguments.get("a"), call.arguments.get("b")
            if not isinstance(a, int) or not isinstance(b, int):
                return ToolResult(json.dumps({"error": "a and b must be integers"}), ok=False,
                                  error_kind="bad_arguments")
            return ToolResult(json.dumps({"result": a + b}))
        if call.name == "lookup":
            return ToolResult(json.dumps({"key": call.arguments.get("key"), "value": 7}))
        return ToolResult(json.dumps({"error": f"unknown tool {call.name}"}), ok=False,
                          error_kind="unknown_tool")

    def score(self, task: Task, trajectory: Trajectory) -> float:
        ans = str(task.payload.get("answer", "5"))
        return 1.0 if trajectory.final_answer and ans in trajectory.final_answer else 0.0


def calc_tasks(n: int) -> list[Task]:
    return [Task(id=f"calc-{i}", split="test",
                 payload={"question": f"Add {i} and {i + 1}.", "answer": str(2 * i + 1)})
            for i in range(n)]


class ScriptedBias:
    """A logits processor for tests: adds `bias` to the next token of a script while the current
    segment (the trailing run of tokens with the role being sampled) is a prefix of that script, so
    a tiny random model emits tool calls / responses / answers often but not always (it deviates
    with probability ~V / (V + e^bias) per token, which exercises malformed and truncated paths).
    A pure function of (context, roles), as the engine requires."""

    def __init__(self, template, *, bias: float = 15.0, parallel: bool = False):
        from fastrehearse.rollout.text.template import format_tool_call
        enc, end = template.encode, template.assistant_end_markers[0]
        call = format_tool_call("add", {"a": 2, "b": 3})
        if parallel:
            call += "\n" + format_tool_call("lookup", {"key": "x"})
        self.call_script = enc(call + end)
        self.answer_script = enc("The answer is 5." + end)
        self.tool_script = enc('{"result": 5}') + enc(template.scaffolding.texts["tool_to_assistant"]
                                                      .split(template.tool_end_markers[0])[0]
                                                      + template.tool_end_markers[0])
        self.bias = bias

    def script(self, ids, roles, role):
        from fastrehearse.kernels.roles import Role
        if role == Role.REHEARSE:
            return self.tool_script
        seen_tool = any(r in (Role.REHEARSE, Role.OBSERVED) for r in roles)
        return self.answer_script if seen_tool else self.call_script

    def __call__(self, contexts, context_roles, sample_roles, logits):
        logits = logits.clone()
        for i, (ids, roles, role) in enumerate(zip(contexts, context_roles, sample_roles)):
            n = 0
            while n < len(roles) and roles[-1 - n] == role:
                n += 1
            seg = ids[len(ids) - n:]
            script = self.script(ids, roles, role)
            if n < len(script) and script[:n] == seg:
                logits[i, script[n]] += self.bias
        return logits


class ScriptedTurns(ScriptedBias):
    """Forces (bias 1e4) a given sequence of assistant turns and tool responses: turn k of the
    policy is `act_texts[k]` (+ end marker), the k-th tool response `tool_texts[k]` (+ tool end).
    Used to drive the engine through gold trajectories end to end."""

    def __init__(self, template, act_texts: list[str], tool_texts: list[str], bias: float = 1e4):
        self.bias = bias
        end = template.assistant_end_markers[0]
        close = template.scaffolding.texts["tool_to_assistant"]
        marker = template.tool_end_markers[0]
        tool_end = close.split(marker)[0] + marker
        self.act = [template.encode(t + end) for t in act_texts]
        self.tool = [template.encode(t) + template.encode(tool_end) for t in tool_texts]

    def script(self, ids, roles, role):
        from fastrehearse.kernels.roles import Role
        kinds = (Role.ACT,) if role == Role.ACT else (Role.REHEARSE, Role.OBSERVED)
        n_runs, prev = 0, None
        for r in roles:
            if r in kinds and prev not in kinds:
                n_runs += 1
            prev = r
        k = n_runs - 1 if roles and roles[-1] == role else n_runs  # index of the current segment
        seq = self.act if role == Role.ACT else self.tool
        return seq[k] if k < len(seq) else []


class MultiTurnCalcEnv(CalcEnv):
    """CalcEnv with the optional protocol members, for engine tests: scripted user turns
    (payload["user_turns"]), a tool added at user turn `payload["add_tool_at"]` (1-based), a stop
    tool `finish` (a control tool), and a user simulator that fails when payload["user_fails"]."""

    control_tools = frozenset({"finish"})
    FINISH = {"type": "function", "function": {"name": "finish", "description": "End the task.",
                                               "parameters": {"type": "object", "properties": {}}}}
    MUL = {"type": "function", "function": {
        "name": "mul", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}

    def reset(self, task: Task) -> ResetResult:
        res = super().reset(task)
        self.task, self.turn, self.finished, self.replies = task, 0, False, []
        self.tools = list(CALC_TOOLS) + [self.FINISH]
        return ResetResult(tools=list(self.tools), messages=res.messages)

    def next_user_message(self, reply=None):
        self.replies.append(reply)
        if self.task.payload.get("user_fails"):
            raise ConnectionError("user simulator unreachable")
        turns = self.task.payload.get("user_turns", [])
        if self.turn >= len(turns):
            return None
        self.turn += 1
        if self.turn == self.task.payload.get("add_tool_at"):
            self.tools.append(self.MUL)
        return {"role": "user", "content": turns[self.turn - 1]}

    def execute(self, call: ToolCall) -> ToolResult:
        if call.name == "finish":
            self.finished = True
            return ToolResult("###STOP###")
        if call.name == "mul":
            self.calls.append(call)
            return ToolResult(json.dumps({"result": call.arguments["a"] * call.arguments["b"]}))
        return super().execute(call)
