"""Policies the eval harness can run: ground-truth replay and a causal LM.

`GoldPolicy` replays each task's gold assistant messages through the same harness, environments and
checkers as a model; a category where it does not score 1.0 has a harness or checker problem.

`ModelPolicy` generates one assistant turn per live episode in one left-padded batch with a KV cache
(transformers `generate`), greedy by default. It can also rehearse tool responses (the model playing
the environment), which test-time rehearsal and the drift fidelity measurement use.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from fastrehearse.envs.base import ToolCall
from fastrehearse.rollout.template import ChatTemplate
from fastrehearse.rollout.toolcall import parse_tool_calls
from fastrehearse.eval.harness import EpisodeState


class GoldPolicy:
    """Replays `task.gold`: the next gold assistant message each turn (tool/user turns come from the
    real environment, not from the gold record)."""
    name = "gold"

    def act(self, states: list[EpisodeState]) -> list[dict]:
        out = []
        for st in states:
            gold = st.task.gold
            if gold is None:
                raise ValueError(f"task {st.task.id!r} has no gold trajectory: --policy gold needs one")
            i = st.scratch.get("gold_i", 0)
            while i < len(gold) and gold[i].get("role") != "assistant":
                i += 1
            if i >= len(gold):
                out.append({"role": "assistant", "content": ""})
            else:
                out.append(copy.deepcopy(gold[i]))
                i += 1
            st.scratch["gold_i"] = i
        return out


@dataclass
class GenConfig:
    max_new_tokens: int = 256          # per assistant turn
    max_response_tokens: int = 128     # per rehearsed tool response
    max_prompt_tokens: int | None = None  # None: the model's context minus max_new_tokens; longer
                                          # contexts drop their oldest turns first
    temperature: float = 0.0           # 0 = greedy (committed turns)
    rehearsal_temperature: float = 0.7 # private rehearsals sample, so parallel drafts differ
    top_p: float = 0.95
    seed: int = 0
    pad_cells: int = 2048 * 2048 * 2   # max B x T^2 of one left-padded prefill (see generate)
    kv_cache_entries: int = 8          # episodes whose KV cache is kept for prefix reuse (LRU)


class ModelPolicy:
    def __init__(self, model, tokenizer, name: str, gen: GenConfig | None = None):
        self.model = model.eval()
        self.tok = tokenizer
        self.name = name
        self.gen = gen or GenConfig()
        self._calls = 0
        self._kv: OrderedDict = OrderedDict()      # key -> (token ids in the cache, DynamicCache)
        self.prefill_tokens_saved = 0
        if self.gen.max_prompt_tokens is None:
            ctx = getattr(model.config, "max_position_embeddings", None) or 8192
            self.gen.max_prompt_tokens = max(256, ctx - self.gen.max_new_tokens)
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        # Same rendering and tool-call protocol as training (rollout.template).
        self.template = ChatTemplate(tokenizer)
        # Decoding stops at any single-token end marker (<|im_end|>, EOS); multi-token markers such
        # as </tool_response> are cut afterwards (the template closes them with <|im_end|> anyway).
        stop = set()
        for m in self.template.assistant_end_markers + self.template.tool_end_markers:
            ids = self.tok.encode(m, add_special_tokens=False)
            if len(ids) == 1:
                stop.add(ids[0])
        if self.tok.eos_token_id is not None:
            stop.add(self.tok.eos_token_id)
        self.stop_ids = sorted(stop)

    # ------------------------------------------------------------------ rendering and generation
    def prompt_ids(self, tools: list[dict], messages: list[dict], open_role: str = "assistant") -> list[int]:
        """Token ids of `messages` followed by an opened turn: "assistant" (the policy's next turn)
        or "tool" (the response to the last assistant turn's next call: the model as environment)."""
        msgs = list(messages)
        while True:
            ids = self._render(tools, msgs, open_role)
            if len(ids) <= self.gen.max_prompt_tokens:
                return ids
            # Too long: drop the oldest turn after the system turn and the first user turn (the task).
            first = 1 if msgs and msgs[0].get("role") == "system" else 0
            if len(msgs) - first <= 2:
                # Still too long (e.g. tau2 telecom's ~11k-token policy prompt on an 8k model): keep
                # the head (instructions, tool schemas) and the latest tokens, cut the middle.
                tail = min(1024, self.gen.max_prompt_tokens // 4)
                return ids[:self.gen.max_prompt_tokens - tail] + ids[-tail:]
            del msgs[first + 1]
            while len(msgs) > first + 1 and msgs[first + 1].get("role") == "tool":
                del msgs[first + 1]   # never leave a tool turn without its call

    def _render(self, tools: list[dict], msgs: list[dict], open_role: str) -> list[int]:
        if open_role == "assistant":
            return self.template.render_prompt(msgs, tools).input_ids
        if open_role != "tool" or not msgs or msgs[-1].get("role") not in ("assistant", "tool"):
            raise ValueError("open_role='tool' needs messages ending with an assistant or tool turn")
        r = self.template.render(msgs, tools)
        end = max(e for s, e, role, mi in r.spans if mi == len(msgs) - 1)
        sc = self.template.scaffolding
        return r.input_ids[:end] + (sc.assistant_to_tool if msgs[-1]["role"] == "assistant"
                                    else sc.tool_to_tool)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                 markers: list[str] | None = None, keys: list[Any] | None = None) -> list[tuple[int, str]]:
        """Batched decode with a KV cache. Returns (generated tokens, text cut at the first end
        marker) per prompt. The token count includes tokens past a multi-token marker: real cost.

        Prompts are grouped by length so a padded group costs at most `pad_cells` (B x T^2)
        attention cells: left padding needs an explicit mask, and a masked prefill takes the
        O(T^2)-memory SDPA path on CPU, while a prompt alone runs unmasked (causal, memory-lean).

        `keys` (one per prompt, e.g. the episode) enable prefix-cache reuse for prompts that run
        alone: the KV cache of that key's previous generation is cropped to the longest common
        token prefix and only the rest is prefilled. Each turn of a long multi-turn episode (BFCL
        multi-turn ~5k-token tool docs, tau2 telecom ~11k-token policy) then costs its new tokens."""
        if not prompts:
            return []
        self._calls += 1
        torch.manual_seed(self.gen.seed * 1_000_003 + self._calls)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        groups, cur = [], []
        for i in order:
            width = len(prompts[i])   # ascending: the newest prompt is the group's widest
            if cur and (len(cur) + 1) * width * width > self.gen.pad_cells:
                groups.append(cur)
                cur = []
            cur.append(i)
        groups.append(cur)
        out: list[tuple[int, str] | None] = [None] * len(prompts)
        for g in groups:
            key = keys[g[0]] if keys is not None and len(g) == 1 else None
            for i, r in zip(g, self._generate_group([prompts[i] for i in g], max_new_tokens,
                                                    temperature, markers, key)):
                out[i] = r
        return out  # type: ignore[return-value]

    def _reuse(self, key: Any, prompt: list[int]):
        """The cached KV of `key` cropped to its common prefix with `prompt` (>= 1 token left to
        prefill), or None."""
        hit = self._kv.pop(key, None)
        if hit is None:
            return None
        ids, cache = hit
        n = 0
        for a, b in zip(ids, prompt):
            if a != b:
                break
            n += 1
        n = min(n, len(prompt) - 1, cache.get_seq_length())
        if n < 32:
            return None
        cache.crop(n - cache.get_seq_length()) if n < cache.get_seq_length() else None
        return cache

    @torch.no_grad()
    def _generate_group(self, prompts, max_new_tokens, temperature, markers, key=None):
        pad = self.tok.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):        # left padding: every row ends where decoding starts
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        device = next(self.model.parameters()).device
        kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=pad,
                                  eos_token_id=self.stop_ids or None)
        if bool(mask.all()):
            kw["attention_mask"] = None if len(prompts) == 1 else mask.to(device)
        else:
            kw["attention_mask"] = mask.to(device)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_p=self.gen.top_p, top_k=0)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if key is not None:
            from transformers import DynamicCache
            cache = self._reuse(key, prompts[0])
            kw["past_key_values"] = cache if cache is not None else DynamicCache(config=self.model.config)
            kw["attention_mask"] = None
            self.prefill_tokens_saved += cache.get_seq_length() if cache is not None else 0
        out = self.model.generate(input_ids=ids.to(device), return_dict_in_generate=key is not None, **kw)
        if key is not None:
            cache = out.past_key_values
            out = out.sequences
            self._kv[key] = (out[0, :cache.get_seq_length()].tolist(), cache)
            while len(self._kv) > self.gen.kv_cache_entries:
                self._kv.popitem(last=False)      # least recently used episode
        markers = markers or self.template.assistant_end_markers
        res = []
        for row in out[:, width:].tolist():
            n = len(row)
            for j, t in enumerate(row):
                if t in self.stop_ids:
                    n = j + 1
                    break
            text = self.tok.decode(row[:n], skip_special_tokens=False)
            cut = min((text.find(m) for m in markers if m in text), default=len(text))
            res.append((n, text[:cut]))
        return res

    # ------------------------------------------------------------------ policy interface
    def act(self, states: list[EpisodeState], notes: list[str | None] | None = None) -> list[dict]:
        prompts = []
        for i, st in enumerate(states):
            msgs = st.messages
            if notes is not None and notes[i]:
                msgs = msgs + [{"role": "system", "content": notes[i]}]
            prompts.append(self.prompt_ids(st.tools, msgs))
        outs = self.generate(prompts, self.gen.max_new_tokens, self.gen.temperature,
                             keys=[episode_key(st) for st in states])
        replies = []
        for st, p, (n, text) in zip(states, prompts, outs):
            st.prompt_tokens += len(p)
            st.gen_tokens += n
            replies.append(parse_turn(text))
        return replies

    def predict_responses(self, states: list[EpisodeState], calls: list[list[ToolCall]]) -> list[list[str]]:
        """The model's own tool response to each call (world model), in the same context as the
        real one: after the assistant turn that made the calls, one tool turn per call."""
        preds, ptoks, gtoks = self.rehearse_calls(
            [st.tools for st in states], [_context_before_tools(st.messages) for st in states], calls,
            keys=[episode_key(st) for st in states])
        for st, p, g in zip(states, ptoks, gtoks):
            st.prompt_tokens += p
            st.rehearsal_tokens += g
        return preds

    def rehearse_calls(self, tools: list[list[dict]], contexts: list[list[dict]],
                       calls: list[list[ToolCall]], keys: list[Any] | None = None,
                       ) -> tuple[list[list[str]], list[int], list[int]]:
        """Play the environment: for context k (ending with the assistant turn that made calls[k]),
        write one tool-response turn per call, each seeing the previous rehearsed ones. Batched
        over contexts. Returns (responses, prompt tokens, generated tokens) per context."""
        preds: list[list[str]] = [[] for _ in contexts]
        ptoks = [0] * len(contexts)
        gtoks = [0] * len(contexts)
        depth = max((len(c) for c in calls), default=0)
        for i in range(depth):
            idx = [k for k, c in enumerate(calls) if i < len(c)]
            prompts = []
            for k in idx:
                ctx = contexts[k] + [
                    {"role": "tool", "name": calls[k][j].name, "content": preds[k][j]} for j in range(i)]
                prompts.append(self.prompt_ids(tools[k], ctx, open_role="tool"))
            outs = self.generate(prompts, self.gen.max_response_tokens, 0.0,
                                 markers=self.template.tool_end_markers,
                                 keys=None if keys is None else [keys[k] for k in idx])
            for k, p, (n, text) in zip(idx, prompts, outs):
                ptoks[k] += len(p)
                gtoks[k] += n
                preds[k].append(text.strip())
        return preds, ptoks, gtoks


def episode_key(st: EpisodeState) -> tuple[str, str]:
    """Prefix-cache key: every generation of one episode shares its conversation prefix."""
    return (st.category, st.task.id)


def _context_before_tools(messages: list[dict]) -> list[dict]:
    """Messages up to and including the last assistant turn (drops tool turns already appended)."""
    j = len(messages)
    while j > 0 and messages[j - 1].get("role") == "tool":
        j -= 1
    return messages[:j]


def parse_turn(text: str) -> dict:
    """Model text -> assistant message (OpenAI shape) via the rollout's parser.

    Only the syntax is checked here (tools=None): whether a call names a real tool with valid
    arguments is for the environment / the benchmark's checker to judge, as it would for any agent.
    Unparseable blocks become {"malformed": why, "kind": error kind} entries in "tool_calls"."""
    parsed = parse_tool_calls(text, None)
    calls = []
    for pc in parsed.calls:
        if pc.ok:
            calls.append({"type": "function", "raw": pc.raw,
                          "function": {"name": pc.call.name, "arguments": pc.call.arguments}})
        else:
            calls.append({"malformed": pc.error, "kind": pc.error_kind, "raw": pc.raw})
    # raw_text: what the model wrote, for checkers that decode it themselves (BFCL single-turn)
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content, "raw_text": text}
    if calls:
        msg["tool_calls"] = calls
    return msg
