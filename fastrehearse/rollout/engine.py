"""World-rehearsal rollout: many episodes at once, one KV cache, the role swap inline.

Every episode is one token sequence that only ever grows. A per-row state machine (`_Row`) decides
what comes next; the batched decode loop (`RolloutEngine._decode`) feeds every live row its pending
tokens each step (the token it just sampled, or forced scaffolding / observed text, several per step
when that keeps the batch busy) and samples the rows that are waiting for the model:

  policy turn (ACT)  --turn ends, calls parsed-->  force "close assistant + open tool turn"
     per call:  rehearse  -> the same model writes the response (REHEARSE) until the tool-turn end
                real      -> env.execute(call); its text is forced (OBSERVED)
                malformed -> an error message is forced (OBSERVED), or the episode ends
     force "close tool + reopen assistant"  -->  next policy turn
  a text reply (no calls) -> env.next_user_message(reply):
     a user message -> rendered with the chat template and forced (CONTEXT) -> next policy turn
     None           -> the episode ends
  env.finished after a tool turn (tau2's stop tool) / max_turns policy turns within one user turn /
  token limits -> the episode ends; then env.score -> reward

The environment protocol (fastrehearse.envs.base) decides everything env-specific: user turns
(none / scripted / a simulator), tools that change mid-task (`env.tools`, re-read after each user
turn: later parsing accepts the new tools and the template renders them as it would), the stop
tool (`finished`, `control_tools`, which are always executed), whether the env judges calls
itself (`validates_calls`), single-turn graded-call tasks (`grades_calls_only`: one turn,
nothing executed) and drift statistics. A policy (fastrehearse.rollout.policy) decides who writes
the agent's turns: the model (sampled or greedy), scripted / gold turns, or a test-time rehearsal.

Token in, token out: episode tokens are exactly the sampled ids plus forced ids; generated text is
decoded only to detect stops and parse calls, never re-tokenized. The rollout log-prob of each
sampled token is log_softmax(logits / temperature) (NaN for forced tokens).

`rehearsal="separate"` replaces inline rehearsal by the paper-code style: a fresh simulator prompt
(the conversation so far + the call) is prefilled and decoded per call, and its tokens are copied
into the episode. It exists to benchmark the two (benchmarks/bench_rollout.py).
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fastrehearse.data import Episode
from fastrehearse.envs.base import Suite, Task, ToolCall, ToolEnv, Trajectory
from fastrehearse.kernels.roles import Role
from fastrehearse.rollout.backend import Generator, HFGenerator
from fastrehearse.rollout.fidelity import FidelityScore, aggregate, score_pair
from fastrehearse.rollout.policy import Policy, Turn, TurnRequest
from fastrehearse.rollout.sampling import sample
from fastrehearse.rollout.template import TOOL_CALL_CLOSE, ChatTemplate
from fastrehearse.rollout.toolcall import ParsedCall, malformed_response, parse_tool_calls

MODES = ("rehearse", "real", "hybrid")
MALFORMED_OUTCOMES = ("error_response", "end_episode")
CUT_OUTCOMES = ("end_turn", "end_episode")
REHEARSALS = ("inline", "separate")

# logits_processor(contexts, context_roles, sample_roles, logits) -> logits: contexts[i] / context_roles[i]
# are row i's tokens and roles so far, sample_roles[i] the role of the token about to be sampled (ACT
# or REHEARSE). It must be a pure function of its inputs (the recorded log-probs are of the processed
# distribution, so a trainer re-forward has to apply it too). Constrained decoding and tests use it.
LogitsProcessor = Callable[[list[list[int]], list[list[int]], list[Role], torch.Tensor], torch.Tensor]

SIMULATOR_SYSTEM = ("You simulate the tool environment of an AI agent. Given the conversation so far and "
                    "the agent's latest tool call, reply with exactly the response the tool would "
                    "return (usually JSON) and nothing else.")


@dataclass
class RolloutConfig:
    mode: str = "rehearse"              # rehearse | real | hybrid
    hybrid_p: float = 0.5               # hybrid: probability that a call is executed for real
    measure_fidelity: bool = False      # rehearsed calls are also executed (for measurement only)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128           # per generated turn (policy turn or rehearsed response)
    on_max_new_tokens: str = "end_turn"  # a turn cut by max_new_tokens: "end_turn" closes it as
                                        # written (the template's end-of-turn forced as CONTEXT; a
                                        # cut agent turn is parsed like any other, as BFCL's runner
                                        # takes a cut output as the reply) or "end_episode"
    max_turns: int = 6                  # policy turns per user turn (the counter restarts at each
                                        # user turn; one-user-turn tasks: per episode). The eval's
                                        # old name for it was max_steps: max_turns is canonical.
    max_episode_tokens: int = 2048      # prompt included: an episode never exceeds it
    parallel_tool_calls: bool = True    # True: a turn ends at its end-of-turn marker and may hold
                                        # several calls; False: it stops at the first </tool_call>
    on_malformed: str = "error_response"  # or "end_episode" (the one vocabulary, train and eval)
    malformed_reward: float | None = 0.0  # reward of an episode with a malformed call (None: score)
    max_batch_size: int = 64            # episodes decoded together
    max_chunk: int = 64                 # most forced tokens fed to one row in one step
    rehearsal: str = "inline"           # inline | separate (benchmark baseline)

    def validate(self) -> None:
        def choice(name, allowed):
            if getattr(self, name) not in allowed:
                raise ValueError(f"RolloutConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        choice("mode", MODES)
        choice("on_malformed", MALFORMED_OUTCOMES)
        choice("on_max_new_tokens", CUT_OUTCOMES)
        choice("rehearsal", REHEARSALS)
        if not 0.0 <= self.hybrid_p <= 1.0:
            raise ValueError(f"RolloutConfig.hybrid_p must be in [0, 1], got {self.hybrid_p}")
        if self.temperature < 0:
            raise ValueError(f"RolloutConfig.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"RolloutConfig.top_p must be in (0, 1], got {self.top_p}")
        for name in ("max_new_tokens", "max_turns", "max_episode_tokens", "max_batch_size", "max_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Prompt:
    """A row to generate from: a token prefix ending where the policy speaks (after a generation
    prompt). `env` None means private rehearsal: every call is rehearsed, nothing is executed."""
    input_ids: list[int]
    roles: list[int]
    tools: list[dict]
    messages: list[dict] = field(default_factory=list)  # the prefix as chat messages (simulator mode)
    task: Task | None = None
    env: ToolEnv | None = None
    seed: int = 0


@dataclass
class RolloutResult:
    episodes: list[Episode]
    trajectories: list[Trajectory]
    metrics: dict[str, Any]


class _Row:
    """One episode's state machine. Phases: "act" (policy turn), "tool" (rehearsing a response),
    "done". Appending tokens and deciding what comes next happens here; the decode loop only feeds
    `pending`, asks the policy for rows that start a turn (`awaiting_turn`) and samples rows whose
    `pending` is empty."""

    def __init__(self, eng: "RolloutEngine", index: int, prompt: Prompt):
        self.eng, self.cfg, self.tmpl = eng, eng.config, eng.template
        self.index, self.p = index, prompt
        self.env = prompt.env
        self.ids = list(prompt.input_ids)
        self.roles = [int(r) for r in prompt.roles]
        self.logps = [math.nan] * len(self.ids)
        self.tools = list(prompt.tools)
        self.pending: deque[int] = deque(self.ids)   # appended but not yet fed to the model
        self.head_sampled = False                     # is pending[0] a token the model sampled?
        self.phase = "act"
        self.seg_start = len(self.ids)
        self.turns = 0                                # policy turns in the episode
        self.turn_steps = 0                           # policy turns since the last user turn
        self.user_turns = 0                           # user turns added after the prompt
        self.awaiting_turn = False                    # the policy must say who writes this turn
        self.cut_turns = 0                            # turns closed at max_new_tokens
        self.turn_context: str | None = None          # CONTEXT the policy put before this turn
        self.stop_reason = ""
        self.error: str | None = None                 # the episode could not run to its end
        self.queue: list[tuple[ParsedCall, str]] = []
        self.traj = Trajectory()
        self.malformed: Counter = Counter()
        self.call_log: list[dict] = []
        self.policy_log: list[dict] = []
        self.tools_changed: list[int] = []            # user turns at which the tools changed
        self.fidelity: list[FidelityScore] = []
        self.rng = random.Random(prompt.seed * 1_000_003 + 17)
        self.gen = torch.Generator().manual_seed(prompt.seed)
        self.waiting_sim: tuple[ParsedCall, str] | None = None  # rehearsal="separate" only
        self.sim_text = ""
        if len(self.ids) >= self.cfg.max_episode_tokens:
            self._finish("max_episode_tokens")
        else:
            self._begin_act()

    # -- token bookkeeping -------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def sample_role(self) -> Role:
        return Role.REHEARSE if self.phase == "tool" else Role.ACT

    def _room(self) -> int:
        return self.cfg.max_episode_tokens - len(self.ids)

    def force(self, tokens: Sequence[int], role: Role = Role.CONTEXT) -> bool:
        """Append known tokens; False (and the episode ends) when they do not fit."""
        tokens = list(tokens)
        fit = tokens[:max(0, self._room())]
        self.ids += fit
        self.roles += [int(role)] * len(fit)
        self.logps += [math.nan] * len(fit)
        self.pending.extend(fit)
        if len(fit) < len(tokens):
            self._finish("max_episode_tokens")
            return False
        return True

    def _finish(self, reason: str) -> None:
        if self.phase == "tool" and self.queue:  # a rehearsal cut short by a limit is still a call
            pc, _ = self.queue.pop(0)
            self.call_log.append({"name": pc.call.name, "mode": "rehearse", "error_kind": None,
                                  "truncated": True})
        self.phase = "done"
        self.awaiting_turn = False
        self.stop_reason = self.stop_reason or reason
        self.pending.clear()

    def _segment_text(self) -> str:
        return self.tmpl.tokenizer.decode(self.ids[self.seg_start:])

    def _new_segment(self, phase: str) -> None:
        self.phase = phase
        self.seg_start = len(self.ids)

    # -- policy turns ------------------------------------------------------------------------
    def _begin_act(self) -> None:
        """A policy turn starts (the sequence ends with the assistant-turn opening)."""
        self._new_segment("act")
        self.turn_context = None
        self.awaiting_turn = self.eng.policy is not None

    def request(self) -> TurnRequest:
        return TurnRequest(row=self.index, task=self.p.task, messages=self.p.messages + self.traj.messages,
                           tools=list(self.tools), input_ids=list(self.ids), roles=list(self.roles),
                           turn=self.turns, seed=self.p.seed)

    def apply_turn(self, turn: Turn | None) -> None:
        """The policy's answer for this turn: None = the model samples it; else forced parts."""
        self.awaiting_turn = False
        if turn is None:
            return
        if not isinstance(turn, Turn):
            raise TypeError(f"policy returned {type(turn).__name__}; expected Turn or None")
        if turn.info:
            self.policy_log.append({"turn": self.turns, **turn.info})
        if turn.context:
            self.turn_context = turn.context
            if not self.force(self.tmpl.encode(turn.context), Role.CONTEXT):
                return
            self.seg_start = len(self.ids)   # the context is never parsed for calls
        if turn.text is not None:
            marker = self.tmpl.assistant_end_markers[0]
            if self.force(self.tmpl.encode(turn.text + marker), Role.ACT):
                self._end_policy_turn(marker)

    # -- sampled tokens ----------------------------------------------------------------------
    def on_sampled(self, token: int, logp: float) -> None:
        self.ids.append(token)
        self.roles.append(int(self.sample_role))
        self.logps.append(logp)
        self.pending.append(token)
        self.head_sampled = True  # pending[0] is this sampled token (pending was empty)
        marker = self._stop_marker()
        seg_len = len(self.ids) - self.seg_start
        cut = marker is None and seg_len >= self.cfg.max_new_tokens
        if cut and self.cfg.on_max_new_tokens == "end_episode":
            self._finish("max_new_tokens")
        elif self.phase == "act" and (marker is not None or cut):
            self.cut_turns += int(cut)
            self._end_policy_turn(marker)
        elif self.phase == "tool" and (marker is not None or cut):
            self.cut_turns += int(cut)
            self._end_rehearsed_response(marker)
        if not self.done and self._room() <= 0:
            self._finish("max_episode_tokens")

    def _stop_marker(self) -> str | None:
        """The stop string completed by the last token (string match on the decoded suffix)."""
        tok = self.tmpl.tokenizer
        seg = self.ids[self.seg_start:]
        if self.phase == "act":
            markers = list(self.tmpl.assistant_end_markers)
            if not self.cfg.parallel_tool_calls:
                markers.append(TOOL_CALL_CLOSE)
        else:
            markers = self.tmpl.tool_end_markers
        if seg[-1] in self.eng.eos_ids:
            return tok.decode(seg[-1:])
        tail = seg[-self.eng.window:]
        now, before = tok.decode(tail), tok.decode(tail[:-1])
        for m in markers:
            if m in now and m not in before:
                return m
        return None

    # -- turn transitions --------------------------------------------------------------------
    def _end_policy_turn(self, marker: str | None) -> None:
        """The agent's turn ended at `marker` (None: cut by max_new_tokens, closed as written)."""
        text = self._segment_text()
        cut = text.rfind(marker) if marker else -1
        turn = text[:cut] if cut >= 0 and marker != TOOL_CALL_CLOSE else text
        env = self.env
        graded_only = env is not None and env.grades_calls_only
        # Graded-call tasks (judged on the raw text by the benchmark's checker) and envs that judge
        # calls themselves: syntax only. Otherwise the name and the arguments' schema too.
        syntax_only = env is not None and (graded_only or env.validates_calls)
        parsed = parse_tool_calls(turn, None if syntax_only else self.tools)
        self.turns += 1
        self.turn_steps += 1
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed.has_calls else turn,
                               "raw_text": turn}
        if self.turn_context is not None:
            msg["context"] = self.turn_context
        if marker is None:
            msg["cut"] = "max_new_tokens"
        ok_calls = [c for c in parsed.calls if c.ok]
        if ok_calls:
            msg["tool_calls"] = [{"type": "function", "function": {"name": c.call.name,
                                                                  "arguments": c.call.arguments}}
                                 for c in ok_calls]
        self.traj.messages.append(msg)
        if graded_only:
            self.traj.final_answer = turn.strip()
            self._finish("graded")
            return
        if not parsed.has_calls:
            self.traj.final_answer = turn.strip()
            self._after_reply(msg, marker)
            return
        self.queue = []
        for c in parsed.calls:
            if not c.ok:
                self.malformed[c.error_kind] += 1
                if self.cfg.on_malformed == "end_episode":
                    self.call_log.append({"name": None, "mode": "malformed", "error_kind": c.error_kind})
                    self._finish("malformed")
                    return
                self.queue.append((c, "error"))
            elif env is None or (self.cfg.mode == "rehearse" and c.call.name not in env.control_tools):
                self.queue.append((c, "rehearse"))
            elif self.cfg.mode == "real" or c.call.name in env.control_tools:
                self.queue.append((c, "real"))
            else:
                self.queue.append((c, "real" if self.rng.random() < self.cfg.hybrid_p else "rehearse"))
        end_marker = marker if marker != TOOL_CALL_CLOSE else None
        if self.force(self.tmpl.remainder("assistant_to_tool", end_marker)):
            self._next_call()

    def _after_reply(self, msg: dict, marker: str | None) -> None:
        """A text reply ended the agent's turn: the environment's next user turn, or the end."""
        env = self.env
        if env is None or env.finished:
            self._finish("final_answer")
            return
        try:
            user = env.next_user_message(msg)
        except Exception as e:  # an unreachable user simulator: the episode could not run
            self.error = f"next_user_message: {type(e).__name__}: {e}"
            self._finish("env_error")
            return
        if user is None:
            self._finish("final_answer")
            return
        if not isinstance(user, dict) or user.get("role") not in ("user", "system") \
                or not isinstance(user.get("content"), str):
            self.error = f"next_user_message returned {user!r}; expected a user message dict"
            self._finish("env_error")
            return
        self.traj.messages.append(user)
        self.user_turns += 1
        self.turn_steps = 0
        tools = env.tools
        if tools is not None and list(tools) != self.tools:
            self.tools = list(tools)
            self.tools_changed.append(self.user_turns)
        end_marker = marker if marker != TOOL_CALL_CLOSE else None
        if self.force(self.tmpl.continuation([user], self.tools, end_marker)):
            self._begin_act()

    def _next_call(self) -> None:
        """Handle queued calls until one needs the model (or the tool turn closes)."""
        while self.queue and not self.done:
            pc, mode = self.queue[0]
            if mode == "rehearse":
                if self.cfg.rehearsal == "separate":
                    self.waiting_sim = (pc, mode)  # the engine runs the simulator prompt
                else:
                    self._new_segment("tool")
                return
            self.queue.pop(0)
            if mode == "error":
                content = malformed_response(pc)
                self.call_log.append({"name": None, "mode": "error", "error_kind": pc.error_kind})
            else:
                content = self._execute(pc.call)
                self.call_log.append({"name": pc.call.name, "mode": "real", "error_kind": None})
            self.traj.messages.append({"role": "tool", "content": content, "rehearsed": False})
            if not self.force(self.tmpl.encode(content), Role.OBSERVED):
                return
            self._close_tool_response(None)

    def _execute(self, call: ToolCall) -> str:
        self.traj.real_calls.append(call)
        try:
            res = self.env.execute(call)
        except Exception as e:  # env contract says never raise; a buggy env must not kill a batch
            self.malformed["env_error"] += 1
            return json.dumps({"error": "env_error", "message": f"{type(e).__name__}: {e}"})
        if not res.ok and res.error_kind:
            self.eng._count_env_error(res.error_kind)
        return res.content

    def _end_rehearsed_response(self, marker: str) -> None:
        pc, _ = self.queue.pop(0)
        content = self.tmpl.tool_content_from_generated(self._segment_text(), marker)
        self._record_rehearsal(pc, content)
        self._close_tool_response(marker)

    def _record_rehearsal(self, pc: ParsedCall, content: str) -> None:
        entry = {"name": pc.call.name, "mode": "rehearse", "error_kind": None}
        if self.cfg.measure_fidelity and self.env is not None:
            real = self._execute(pc.call)
            s = score_pair(pc.call.name, content, real)
            self.fidelity.append(s)
            entry.update(measured=True, exact=s.exact, field_f1=s.field_f1)
        self.call_log.append(entry)
        self.traj.messages.append({"role": "tool", "content": content, "rehearsed": True})

    def _close_tool_response(self, marker: str | None) -> None:
        if self.queue:
            if self.force(self.tmpl.remainder("tool_to_tool", marker)):
                self._next_call()
            return
        if self.env is not None and self.env.finished:
            self._finish("finished")
            return
        if self.turn_steps >= self.cfg.max_turns:
            self._finish("max_turns")
            return
        if self.force(self.tmpl.remainder("tool_to_assistant", marker)):
            self._begin_act()

    def on_simulated(self, tokens: list[int], logps: list[float], text: str) -> None:
        """rehearsal="separate": the simulator's response tokens, copied in as REHEARSE."""
        pc, _ = self.waiting_sim
        self.waiting_sim = None
        self.queue.pop(0)
        room = self._room()
        self.ids += tokens[:room]
        self.roles += [int(Role.REHEARSE)] * len(tokens[:room])
        self.logps += logps[:room]
        self.pending.extend(tokens[:room])
        if len(tokens) > room:
            self._finish("max_episode_tokens")
            return
        self._record_rehearsal(pc, text.strip())
        self._close_tool_response(None)

    # -- result ------------------------------------------------------------------------------
    def episode(self) -> Episode:
        task, env = self.p.task, self.env
        reward = 0.0
        error = self.error
        if env is not None and task is not None and error is None:
            try:
                reward = float(env.score(task, self.traj))
            except Exception as e:  # a scoring bug is an outcome, not a crash of the whole batch
                error = f"score: {type(e).__name__}: {e}"
                reward = 0.0
        if self.malformed and self.cfg.malformed_reward is not None:
            reward = float(self.cfg.malformed_reward)
        meta = {"stop_reason": self.stop_reason, "turns": self.turns, "user_turns": self.user_turns,
                "cut_turns": self.cut_turns,
                "calls": self.call_log, "malformed": dict(self.malformed), "seed": self.p.seed,
                "prompt_tokens": len(self.p.input_ids),
                "fidelity": [vars(s) for s in self.fidelity]}  # JSON-friendly; trajectories are
        # returned beside the episodes (RolloutResult.trajectories)
        if self.tools_changed:
            meta["tools_changed"] = self.tools_changed
        if self.policy_log:
            meta["policy"] = self.policy_log
        if env is not None:
            drift = env.drift_stats()
            if drift:
                meta["drift"] = dict(drift)
        if error:
            # The episode could not run (or be scored) to its end: its reward is not a result.
            # Evaluation records it as an error, not a score.
            meta["error"] = error
            if error.startswith("score: "):
                meta["score_error"] = error[len("score: "):]
        return Episode(input_ids=self.ids, roles=self.roles, task_id=task.id if task else "",
                       reward=reward, rollout_logprobs=self.logps, metadata=meta)


class RolloutEngine:
    """Batched world-rehearsal rollouts over a causal LM (see the module docstring).

    engine = RolloutEngine(model, tokenizer, RolloutConfig(mode="hybrid", hybrid_p=0.3))
    result = engine.rollout(tasks, suite, group_size=4, seed=0)   # episodes, trajectories, metrics
    result = engine.rollout(tasks, suite, policy=GoldPolicy())    # who writes the agent's turns
    result = engine.generate(prompts)                              # from token prefixes (no env:
                                                                   # private rehearsal)
    `model` may be None when no token will ever be sampled (a policy that forces every turn, with
    mode="real"): a row that needs the model then raises.
    """

    def __init__(self, model, tokenizer, config: RolloutConfig | None = None, *,
                 template: ChatTemplate | None = None, backend_factory: Callable[[], Generator] | None = None,
                 logits_processor: LogitsProcessor | None = None):
        self.config = config or RolloutConfig()
        self.config.validate()
        self.model = model
        self.template = template or ChatTemplate(tokenizer)
        tok = self.template.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.backend_factory = backend_factory or (lambda: HFGenerator(self._need_model(), pad_id=self.pad_id))
        self.logits_processor = logits_processor
        self.eos_ids = {i for i in (tok.eos_token_id,) if i is not None}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_ids |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]) - {None}
        for m in self.template.assistant_end_markers:
            ids = tok.encode(m, add_special_tokens=False)
            if len(ids) == 1:
                self.eos_ids.add(ids[0])
        # Decode window for stop detection: enough tokens to spell the longest marker.
        longest = max(len(tok.encode(m, add_special_tokens=False))
                      for m in self.template.assistant_end_markers + self.template.tool_end_markers
                      + [TOOL_CALL_CLOSE])
        self.window = longest + 8
        self._env_errors: Counter = Counter()
        self.policy: Policy | None = None     # the token source of the current generate() call

    def _count_env_error(self, kind: str) -> None:
        self._env_errors[kind] += 1

    def _need_model(self):
        if self.model is None:
            raise ValueError("RolloutEngine(model=None) cannot sample: a row needs the model (a policy "
                             "that does not force every turn, or a rehearsed call)")
        return self.model

    # -- public API ----------------------------------------------------------------------------
    def prompt_for(self, task: Task, env: ToolEnv, seed: int) -> Prompt:
        reset = env.reset(task)
        r = self.template.render_prompt(reset.messages, reset.tools)
        return Prompt(r.input_ids, r.roles, reset.tools, list(reset.messages), task, env, seed)

    def rollout(self, tasks: Sequence[Task], envs: Suite | Callable[[], ToolEnv], *,
                group_size: int = 1, seed: int = 0, policy: Policy | None = None) -> RolloutResult:
        """`group_size` episodes per task (the GRPO group), each with its own environment.
        `policy` (fastrehearse.rollout.policy): who writes the agent's turns; None: the model."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        make_env = envs.make_env if isinstance(envs, Suite) else envs
        if not callable(make_env):
            raise ValueError("envs must be a Suite or a callable returning a ToolEnv")
        prompts = []
        try:
            for ti, task in enumerate(tasks):
                for g in range(group_size):
                    env = make_env()
                    if not isinstance(env, ToolEnv):
                        raise TypeError(f"the env factory returned {type(env).__name__}, not a "
                                        "fastrehearse.envs.base.ToolEnv (the protocol the engine reads)")
                    try:
                        prompts.append(self.prompt_for(task, env, seed * 7_919_993 + ti * group_size + g))
                    except BaseException:
                        env.close()
                        raise
            result = self.generate(prompts, policy=policy)
        finally:
            for p in prompts:
                try:
                    p.env.close()
                except Exception:
                    pass
        for ep, (ti, g) in zip(result.episodes, [(i, g) for i in range(len(tasks)) for g in range(group_size)]):
            ep.metadata.update(group=ti, sample=g)
        return result

    def generate(self, prompts: Sequence[Prompt], *, policy: Policy | None = None) -> RolloutResult:
        """Run rows from token prefixes. Rows without an env only rehearse (test-time rehearsal).
        `policy` as in `rollout`."""
        for i, p in enumerate(prompts):
            if len(p.input_ids) == 0 or len(p.input_ids) != len(p.roles):
                raise ValueError(f"prompts[{i}]: input_ids must be non-empty and match roles")
        t0 = time.perf_counter()
        stats = Counter()
        # Reentrant: a policy may call generate() on this engine for private rehearsals while an
        # outer generate() waits for its answer; the outer call's policy and counters come back.
        outer = (self.policy, self._env_errors)
        self.policy, self._env_errors = policy, Counter()
        try:
            rows = [_Row(self, i, p) for i, p in enumerate(prompts)]
            bs = self.config.max_batch_size
            for s in range(0, len(rows), bs):
                batch = rows[s:s + bs]
                self._resolve_turns(batch, stats)
                self._decode([r for r in batch if not r.done], stats)
            episodes = [r.episode() for r in rows]
            wall = time.perf_counter() - t0
            return RolloutResult(episodes, [r.traj for r in rows], self._metrics(rows, episodes, stats, wall))
        finally:
            self.policy, self._env_errors = outer

    # -- the decode loop ---------------------------------------------------------------------------
    def _resolve_turns(self, rows: list[_Row], stats: Counter) -> None:
        """Ask the policy, in one batched call, who writes the turn of every row starting one; a
        forced turn may run the row up to its next turn (real calls, user turns): repeat."""
        if self.policy is None:
            return
        while True:
            waiting = [r for r in rows if r.awaiting_turn and not r.done]
            if not waiting:
                return
            turns = self.policy.begin_turns([r.request() for r in waiting])
            if len(turns) != len(waiting):
                raise ValueError(f"policy.begin_turns returned {len(turns)} turns for {len(waiting)} requests")
            stats["policy_calls"] += 1
            for r, t in zip(waiting, turns):
                stats["forced_turns"] += int(t is not None and t.text is not None)
                r.apply_turn(t)

    def _sample(self, rows: list[_Row], logits: torch.Tensor, stats: Counter) -> None:
        if self.logits_processor is not None:
            logits = self.logits_processor([r.ids for r in rows], [r.roles for r in rows],
                                           [r.sample_role for r in rows], logits)
        u = torch.stack([torch.rand((), generator=r.gen) for r in rows])
        tok, logp = sample(logits, self.config.temperature, self.config.top_p, u)
        stats["decode_tokens"] += len(rows)
        for r, t, lp in zip(rows, tok.tolist(), logp.tolist()):
            r.on_sampled(int(t), float(lp))

    def _chunk(self, rows: list[_Row]) -> int:
        """Tokens per row this step: several when forced tokens are waiting and at least half of the
        step's token slots are real (padding slots become masked cache holes)."""
        k = min(self.config.max_chunk, max(len(r.pending) for r in rows))
        while k > 1 and sum(min(k, len(r.pending)) for r in rows) * 2 < k * len(rows):
            k //= 2
        return max(k, 1)

    def _decode(self, rows: list[_Row], stats: Counter) -> None:
        if not rows:
            return
        gen = self.backend_factory()
        prompts = [list(r.pending) for r in rows]
        for r in rows:
            r.pending.clear()
        stats["prefill_tokens"] += sum(map(len, prompts))
        stats["forward_calls"] += 1
        logits = gen.start(prompts)
        stats["prefill_reused_tokens"] += getattr(gen, "reused_tokens", 0)
        self._sample(rows, logits, stats)
        live = rows
        while True:
            self._simulate([r for r in live if r.waiting_sim is not None], stats)
            self._resolve_turns(live, stats)
            keep = [i for i, r in enumerate(live) if not r.done]
            if not keep:
                return
            if len(keep) < len(live):
                gen.keep(keep)
                live = [live[i] for i in keep]
            k = self._chunk(live)
            feed = []
            for r in live:  # a live row always has pending tokens: it just sampled or was forced
                f = [r.pending.popleft() for _ in range(min(k, len(r.pending)))]
                stats["prefill_tokens"] += len(f) - int(r.head_sampled)
                stats["decode_fed"] += int(r.head_sampled)
                r.head_sampled = False
                feed.append(f)
            stats["forward_calls"] += 1
            stats["token_slots"] += k * len(live)
            stats["fed_tokens"] += sum(map(len, feed))
            logits = gen.step(feed)
            ready = [i for i, r in enumerate(live) if not r.pending and r.waiting_sim is None]
            if ready:
                self._sample([live[i] for i in ready], logits[ready], stats)

    def _simulate(self, rows: list[_Row], stats: Counter) -> None:
        """rehearsal="separate": prompt a fresh simulator per call with the conversation so far and
        decode its response (the paper-code style), then copy its tokens into the episode."""
        if not rows:
            return
        prompts = []
        for r in rows:
            pc, _ = r.waiting_sim
            convo = json.dumps(r.p.messages + r.traj.messages, ensure_ascii=False, default=str)
            msgs = [{"role": "system", "content": SIMULATOR_SYSTEM},
                    {"role": "user", "content": f"Tools: {json.dumps(r.tools)}\nConversation: {convo}\n"
                                                f"Tool call: {pc.raw.strip()}"}]
            sim = self.template.render_prompt(msgs)
            prompts.append(Prompt(sim.input_ids, sim.roles, [], seed=r.rng.randrange(2**31)))
        sub = RolloutEngine.__new__(RolloutEngine)
        sub.__dict__.update(self.__dict__)
        sub.policy = None
        sub.config = RolloutConfig(**{**vars(self.config), "rehearsal": "inline", "max_turns": 1,
                                      "parallel_tool_calls": True})
        sim_rows = [_Row(sub, i, p) for i, p in enumerate(prompts)]
        sub._decode([s for s in sim_rows if not s.done], stats)
        stats["simulator_prompts"] += len(sim_rows)
        for r, s in zip(rows, sim_rows):
            gen_ids = s.ids[len(s.p.input_ids):]
            gen_lp = s.logps[len(s.p.input_ids):]
            text = self.template.tokenizer.decode(gen_ids)
            for m in self.template.assistant_end_markers:  # drop the simulator's end-of-turn
                if text.endswith(m):
                    n = len(self.template.encode(m))
                    gen_ids, gen_lp, text = gen_ids[:-n], gen_lp[:-n], text[:-len(m)]
                    break
            r.on_simulated(gen_ids, gen_lp, text)

    # -- metrics -------------------------------------------------------------------------------------
    def _metrics(self, rows: list[_Row], episodes: list[Episode], stats: Counter, wall: float) -> dict:
        role_tokens = Counter()
        for ep in episodes:
            for r, n in Counter(ep.roles).items():
                role_tokens[Role(r).name] += n
        malformed, modes, stops = Counter(), Counter(), Counter()
        fid: list[FidelityScore] = []
        errors = sum(1 for e in episodes if "error" in e.metadata)
        for r in rows:
            malformed.update(r.malformed)
            modes.update(c["mode"] for c in r.call_log)
            stops[r.stop_reason] += 1
            fid += r.fidelity
        total = stats["prefill_tokens"] + stats["decode_fed"]
        return {
            "episodes": len(episodes),
            "wall_s": wall,
            # all tokens through the model (prefill + decode) and sampled tokens, per second
            "tokens_per_s": total / wall if wall > 0 else 0.0,
            "decode_tokens_per_s": stats["decode_tokens"] / wall if wall > 0 else 0.0,
            "prefill_tokens": stats["prefill_tokens"],   # prompt + forced tokens of the rows
            # ... of which not computed: a duplicate row's prompt, or a prefix from a PrefixCache
            "prefill_reused_tokens": stats["prefill_reused_tokens"],
            "decode_tokens": stats["decode_tokens"],     # tokens sampled by the model
            "forward_calls": stats["forward_calls"],
            "token_slot_efficiency": (stats["fed_tokens"] / stats["token_slots"]) if stats["token_slots"] else 1.0,
            "simulator_prompts": stats["simulator_prompts"],
            "role_tokens": dict(role_tokens),
            "calls": dict(modes),
            "malformed": dict(malformed),
            "env_errors": dict(self._env_errors),
            "stop_reasons": dict(stops),
            "user_turns": sum(r.user_turns for r in rows),   # user turns added after the prompts
            "cut_turns": sum(r.cut_turns for r in rows),     # turns closed at max_new_tokens
            "forced_turns": stats["forced_turns"],           # agent turns a policy forced
            "errors": errors,                                # episodes that could not run / score
            "mean_reward": sum(e.reward for e in episodes) / len(episodes) if episodes else 0.0,
            "fidelity": aggregate(fid),
        }
