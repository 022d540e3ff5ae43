"""Test-time rehearsal as a token source of the rollout engine: think with the world model before
committing a real turn.

Before each committed agent turn, `RehearsalPolicy.begin_turns` runs up to N *private* rehearsals of
the next step(s) on a private engine (`engine.generate` on prompts without an environment: every
call the draft makes is answered by the model itself playing the environment, nothing executes).

  parallel:   N independent sampled drafts (rehearsal temperature > 0), one batch of B*N rows.
  sequential: draft k starts from the memory of drafts 1..k-1 (as CONTEXT) and can revise them.

Two forms of using them (`form`):
  memory  (the paper's form) each draft (`horizon` agent turns with their predicted responses) is
          followed by the model's own short self-assessment (a private turn answering
          ASSESS_PROMPT); drafts and assessments are condensed into one rehearsal memory, placed as
          CONTEXT at the start of the committed turn (`Turn(context=...)`), and the model then
          writes the one committed turn, which the engine executes for real. Exactly one memory per
          committed turn; it stays in the episode's tokens (token in, token out).
  select  no memory. The committed source's own turn (the greedy turn for a greedy model) is
          rehearsed too, and the engine commits whichever candidate (that turn first, then the
          drafts) the world model judges best (`judge`): a malformed call or an unknown tool is a
          sure failure (-2), a predicted error response a likely one (-1), anything else 0. Ties go
          to the greedy turn, so `select` changes a turn only when rehearsal foresees a failure of
          the greedy one and a draft without it.

Prefill: the private engines share one `PrefixCache` (fastrehearse/rollout/backends/prefix_cache.py,
`prefix_cache_bytes`, 0 = off): the drafts of a turn prefill the committed context once, and the
next turn's rehearsals only the tokens added since. Without it every draft, the greedy candidate
and every assessment re-prefilled the whole context (on BFCL multi-turn ~7.4k tokens each).

Cost: every token sampled privately (drafts, predicted responses, assessments, the select-mode
greedy candidate) is counted per committed turn in `Turn.info["rehearsal_tokens"]`, apart from the
committed turn's tokens; the eval stores it as `rehearsal_tokens` per item.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace

from fastrehearse.kernels.roles import Role
from fastrehearse.rollout.backends.generator import HFGenerator
from fastrehearse.rollout.backends.prefix_cache import PrefixCache
from fastrehearse.rollout.config import Prompt, RolloutConfig
from fastrehearse.rollout.engine.engine import RolloutEngine
from fastrehearse.rollout.engine.policy import ModelPolicy, Turn, TurnRequest
from fastrehearse.rollout.text.template import assistant_text

MODES = ("parallel", "sequential")
FORMS = ("memory", "select")
MEMORY_HEAD = ("[Rehearsal memory: private, simulated by me, nothing was executed; the real tools may "
               "answer differently.]")
MEMORY_TAIL = "[End of rehearsal memory.]"
DEFAULT_PREFIX_CACHE_BYTES = 4 << 30   # per GiB: ~23k tokens of SmolLM2-135M fp32 KV, ~7k of Qwen3-8B bf16
ASSESS_PROMPT = ("In one or two sentences: did this rehearsed step work, and what should the real next "
                 "step do?")


@dataclass
class Draft:
    """One private rehearsal: its agent turns, the predicted response texts of each turn's calls
    (malformed-call feedback included), and the model's assessment (memory form)."""
    steps: list[tuple[dict, list[str]]] = field(default_factory=list)
    malformed_first: int = 0      # malformed calls in the first turn
    assessment: str = ""
    tokens: int = 0               # tokens sampled privately for this draft


class RehearsalPolicy:
    """`base`: the committed turns' source (default: the model samples; greedy at temperature 0);
    `draft`: the private drafts' source (default: the model samples at `temperature`). Tests script
    either with fastrehearse.rollout.engine.policy.ScriptedPolicy."""

    def __init__(self, model, tokenizer, budget: int, *, form: str = "memory", mode: str = "parallel",
                 horizon: int = 1, temperature: float = 0.7, max_new_tokens: int = 256,
                 max_episode_tokens: int | None = None, assess_tokens: int = 48, memory_chars: int = 240,
                 base=None, draft=None, prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                 backend: str = "hf"):
        if budget < 0:
            raise ValueError(f"rehearsal budget must be >= 0, got {budget}")
        if mode not in MODES:
            raise ValueError(f"rehearsal mode must be one of {MODES}, got {mode!r}")
        if form not in FORMS:
            raise ValueError(f"rehearsal form must be one of {FORMS}, got {form!r}")
        if horizon < 1:
            raise ValueError(f"rehearsal horizon must be >= 1, got {horizon}")
        if not temperature >= 0:
            raise ValueError(f"rehearsal temperature must be >= 0, got {temperature}")
        self.budget, self.form, self.mode, self.horizon = budget, form, mode, horizon
        self.memory_chars = memory_chars
        self.base = base or ModelPolicy()
        self.draft = draft or ModelPolicy()
        if not isinstance(prefix_cache_bytes, int) or prefix_cache_bytes < 0:
            raise ValueError(f"rehearsal prefix_cache_bytes must be an int >= 0, got {prefix_cache_bytes!r}")
        # One store for all private engines; assessments (prompts that end in a private question,
        # never extended later) read it but do not fill it.
        # backend="vllm": the private engines share the process's one vLLM instance, whose prefix
        # cache replaces this one (fastrehearse/rollout/backends/vllm_backend.py).
        self.prefix_cache = (PrefixCache(prefix_cache_bytes) if prefix_cache_bytes and model is not None
                             and backend == "hf" else None)
        ctx = max_episode_tokens or int(getattr(getattr(model, "config", None), "max_position_embeddings",
                                                None) or 8192)

        self._model = model

        def engine(temp: float, turns: int, new_tokens: int, writes: bool = True) -> RolloutEngine:
            e = RolloutEngine(model, tokenizer, RolloutConfig(
                mode="rehearse", temperature=temp, max_new_tokens=new_tokens, max_turns=turns,
                max_episode_tokens=ctx, backend=backend))
            if self.prefix_cache is not None:
                e.backend_factory = self.backend_factory(e, writes=writes)
            return e
        self.drafts = engine(temperature, horizon, max_new_tokens)      # private drafts
        self.greedy = engine(0.0, 1, max_new_tokens)                    # select: the committed candidate
        self.assess = engine(0.0, 1, assess_tokens, writes=False)       # memory: self-assessments
        self.template = self.drafts.template
        self.selected_drafts = 0      # select: committed turns taken from a draft

    def backend_factory(self, engine: RolloutEngine, *, writes: bool = False):
        """Generators for `engine` over this policy's prefix cache (None without one). The
        evaluation's committed engine takes one (read-only): its first prefill of an item is the
        context the first rehearsal of that item has just stored."""
        if self.prefix_cache is None:
            return None
        model, cache, pad = self._model, self.prefix_cache, engine.pad_id
        return lambda: HFGenerator(model, pad_id=pad, prefix_cache=cache, cache_writes=writes)

    # -- engine token-source interface ----------------------------------------------------------
    def begin_turns(self, requests: list[TurnRequest]) -> list[Turn | None]:
        if self.budget == 0 or not requests:
            return self.base.begin_turns(requests)
        drafts = self._rehearse(requests)
        if self.form == "select":
            return self._select(requests, drafts)
        out = []
        for req, ds in zip(requests, drafts):
            memory = self.memory(ds)
            out.append(Turn(context=memory + "\n", info={
                "rehearsal_tokens": sum(d.tokens for d in ds), "memory": True, "drafts": len(ds)}))
        # the committed text (None: the model samples it after reading the memory) comes from base
        for t, b in zip(out, self.base.begin_turns(requests)):
            if b is not None:
                t.text = b.text
        return out

    # -- private rehearsals ----------------------------------------------------------------------
    def _rehearse(self, requests: list[TurnRequest]) -> list[list[Draft]]:
        drafts: list[list[Draft]] = [[] for _ in requests]
        if self.mode == "parallel":
            slots = [(i, k) for i in range(len(requests)) for k in range(self.budget)]
            for (i, _), d in zip(slots, self._run(requests, slots, [None] * len(slots))):
                drafts[i].append(d)
        else:
            for k in range(self.budget):
                slots = [(i, k) for i in range(len(requests))]
                mems = [self.memory(drafts[i], close=False) if drafts[i] else None for i in range(len(requests))]
                for (i, _), d in zip(slots, self._run(requests, slots, mems)):
                    drafts[i].append(d)
        if self.form == "memory":
            self._assess(requests, drafts)
        return drafts

    def _prompt(self, req: TurnRequest, k: int, prefix: str | None, salt: str) -> Prompt:
        ids, roles = list(req.input_ids), list(req.roles)
        if prefix:
            extra = self.template.encode(prefix + "\n")
            ids += extra
            roles += [int(Role.CONTEXT)] * len(extra)
        return Prompt(ids, roles, list(req.tools), list(req.messages), task=req.task, env=None,
                      seed=_seed(req.seed, req.turn, k, salt))

    def _run(self, requests: list[TurnRequest], slots: list[tuple[int, int]], prefixes: list[str | None]
             ) -> list[Draft]:
        prompts = [self._prompt(requests[i], k, p, "draft") for (i, k), p in zip(slots, prefixes)]
        res = self.drafts.generate(prompts, policy=_Offset(self.draft, [requests[i].turn for i, _ in slots]))
        tok = self.template.tokenizer
        return [_draft(p, ep, traj, tok) for p, ep, traj in zip(prompts, res.episodes, res.trajectories)]

    def _assess(self, requests: list[TurnRequest], drafts: list[list[Draft]]) -> None:
        """The model's own short assessment after each draft (a private user turn asks for it)."""
        prompts, which = [], []
        for i, (req, ds) in enumerate(zip(requests, drafts)):
            for k, d in enumerate(ds):
                msgs = list(req.messages)
                for msg, preds in d.steps:
                    msgs.append({k2: v for k2, v in msg.items() if k2 in ("role", "content", "tool_calls")})
                    msgs += [{"role": "tool", "content": p} for p in preds]
                msgs.append({"role": "user", "content": ASSESS_PROMPT})
                r = self.template.render_prompt(msgs, req.tools)
                prompts.append(Prompt(r.input_ids, r.roles, list(req.tools), msgs, task=None, env=None,
                                      seed=_seed(req.seed, req.turn, k, "assess")))
                which.append((i, k))
        if not prompts:
            return
        res = self.assess.generate(prompts)
        for (i, k), p, ep, traj in zip(which, prompts, res.episodes, res.trajectories):
            d = drafts[i][k]
            d.tokens += _sampled(ep, len(p.input_ids))
            first = next((m for m in traj.messages if m.get("role") == "assistant"), None)
            if first is not None:
                d.assessment = (first.get("raw_text") or first.get("content") or "").strip()
            else:   # cut by assess_tokens: what it wrote so far
                d.assessment = self.template.tokenizer.decode(ep.input_ids[len(p.input_ids):]).strip()

    # -- select ----------------------------------------------------------------------------------
    def _select(self, requests: list[TurnRequest], drafts: list[list[Draft]]) -> list[Turn | None]:
        prompts = [self._prompt(r, 0, None, "greedy") for r in requests]
        res = self.greedy.generate(prompts, policy=_Offset(self.base, [r.turn for r in requests]))
        tok = self.template.tokenizer
        greedy = [_draft(p, ep, tr, tok) for p, ep, tr in zip(prompts, res.episodes, res.trajectories)]
        base_turns = self.base.begin_turns(requests)
        out: list[Turn | None] = []
        for req, g, ds, b in zip(requests, greedy, drafts, base_turns):
            names = tool_names(req.tools)
            best, best_score = None, judge_draft(g, names)
            for d in ds:
                sc = judge_draft(d, names)
                if sc > best_score:
                    best, best_score = d, sc
            info = {"rehearsal_tokens": g.tokens + sum(d.tokens for d in ds), "from_draft": best is not None,
                    "score": best_score}
            if best is None:   # the committed source's own turn (the model re-samples it: greedy is
                turn = b or Turn()          # deterministic, so it writes the candidate just judged)
                turn.info = {**turn.info, **info}
            else:
                self.selected_drafts += 1
                turn = Turn(text=assistant_text(best.steps[0][0]), info=info)
            out.append(turn)
        return out

    # -- memory ----------------------------------------------------------------------------------
    def memory(self, drafts: list[Draft], close: bool = True) -> str:
        lines = [MEMORY_HEAD]
        for n, d in enumerate(drafts, 1):
            parts = []
            for msg, preds in d.steps:
                calls = msg.get("tool_calls") or []
                for tc, pr in zip(calls, preds):
                    parts.append(f"{_call_str(tc)} -> predicted: {_clip(pr, self.memory_chars)}")
                if not calls:
                    parts.append(f"answer: {_clip(msg.get('content') or '', self.memory_chars)}")
            if d.malformed_first:
                parts.append(f"{d.malformed_first} malformed tool call(s)")
            line = f"Rehearsal {n}: " + " ; then ".join(parts or ["(empty)"])
            if d.assessment:
                line += f" | my assessment: {_clip(d.assessment, self.memory_chars)}"
            lines.append(line)
        if close:
            lines.append(MEMORY_TAIL)
        return "\n".join(lines)


class _Offset:
    """A token source seen from a private engine: the private episode's turn k is the committed
    episode's turn `offset + k` (gold / scripted sources index turns)."""

    def __init__(self, inner, offsets: list[int]):
        self.inner, self.offsets = inner, offsets

    def begin_turns(self, requests: list[TurnRequest]) -> list[Turn | None]:
        return self.inner.begin_turns([replace(r, turn=r.turn + self.offsets[r.row]) for r in requests])


def _trailing(ep, tokenizer) -> tuple[int | None, str]:
    """(role, text) of the run of same-role tokens the episode ends with."""
    if not ep.roles:
        return None, ""
    i = len(ep.roles)
    while i > 0 and ep.roles[i - 1] == ep.roles[-1]:
        i -= 1
    return ep.roles[-1], tokenizer.decode(ep.input_ids[i:])


def _draft(prompt: Prompt, ep, traj, tokenizer) -> Draft:
    d = Draft(tokens=_sampled(ep, len(prompt.input_ids)))
    msgs = traj.messages
    i = 0
    while i < len(msgs):
        m = msgs[i]
        i += 1
        if m.get("role") != "assistant":
            continue
        preds, bad = [], 0
        while i < len(msgs) and msgs[i].get("role") == "tool":
            if msgs[i].get("rehearsed") is False:
                bad += 1       # no env: a tool turn not rehearsed is malformed-call feedback
            else:
                preds.append(msgs[i].get("content") or "")
            i += 1
        if not d.steps:
            d.malformed_first = bad
        d.steps.append((m, preds))
    if ep.metadata.get("stop_reason") == "max_new_tokens":
        # A private turn or response cut by the token limit leaves no message: keep what was written.
        role, text = _trailing(ep, tokenizer)
        if role == int(Role.REHEARSE) and d.steps:
            d.steps[-1][1].append(text + " [cut]")
        elif role == int(Role.ACT) and len(ep.input_ids) > len(prompt.input_ids):
            d.steps.append(({"role": "assistant", "content": text + " [cut]"}, []))
    return d


def _sampled(ep, start: int) -> int:
    """Tokens the model sampled after the prompt (forced tokens have NaN log-probs)."""
    return sum(1 for lp in (ep.rollout_logprobs or [])[start:] if lp == lp)


def _seed(seed: int, turn: int, k: int, salt: str) -> int:
    h = hashlib.sha256(f"{seed}:{turn}:{k}:{salt}".encode()).digest()
    return int.from_bytes(h[:4], "little")


def looks_like_error(response: str) -> bool:
    """A (predicted) tool response that reports failure: text starting with "Error" (BFCL, tau2) or
    a JSON object with an error key at the top (builtin: {"error": ...})."""
    s = response.strip()
    if s[:5].lower() == "error":
        return True
    try:
        obj = json.loads(s)
    except (json.JSONDecodeError, ValueError):
        return False
    return isinstance(obj, dict) and any("error" in str(k).lower() for k in obj)


def judge(msg: dict, predicted: list[str], tool_names_: set[str] | None, malformed: int = 0) -> int:
    """World-model judgement of one candidate turn: -2 a sure failure (malformed call, or a call to a
    tool that does not exist), -1 a predicted error response, 0 otherwise (including a final answer:
    rehearsal cannot tell a right answer from a wrong one, so it does not prefer calling)."""
    tcs = msg.get("tool_calls") or []
    if malformed:
        return -2
    if tool_names_ and any(tc["function"]["name"] not in tool_names_ for tc in tcs):
        return -2
    if any(looks_like_error(p) for p in predicted):
        return -1
    return 0


def judge_draft(d: Draft, names: set[str]) -> int:
    if not d.steps:
        return -2    # the draft never completed a turn (a token limit cut it)
    msg, preds = d.steps[0]
    return judge(msg, preds, names, d.malformed_first)


def tool_names(tools: list[dict]) -> set[str]:
    """Names of the episode's tools (OpenAI {"type": "function", "function": {...}} or bare schemas)."""
    out = set()
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(f, dict) and f.get("name"):
            out.add(str(f["name"]))
    return out


def _call_str(tc: dict) -> str:
    fn = tc.get("function", tc)
    return f"{fn['name']}({json.dumps(fn.get('arguments') or {}, sort_keys=True)})"


def _clip(s: str, n: int) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."
