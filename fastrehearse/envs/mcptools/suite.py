"""McpSuite / McpEnv: any MCP server (stdio) plus a task file as a fastrehearse environment.

Tool schemas come from the server's `tools/list` (read once, when the suite is built: a server that
cannot start is refused there, in one line naming its command); the world-model reward's response
format from each tool's `outputSchema` where the server declares one. Calls go to the server only
when the engine executes them for real (mode real / hybrid, fidelity measurement); in rehearse mode
the model writes every response and no episode starts a server.

Episodes never share state (the env protocol's promise); `isolation` says how (docs/envs.md):
  process        a server process per episode, started at the episode's first real call and
                 stopped when the episode closes; "{episode_dir}" in the command is replaced by a
                 fresh empty folder of the episode (e.g. `--db {episode_dir}/shop.sqlite`)
  reset:TOOL     a pool of servers reused one episode at a time: an episode takes an idle server
                 at its first real call and calls TOOL (no arguments) on it first; TOOL is never
                 shown to the agent. "{episode_dir}" is a folder per pooled server
  argument:NAME  one server for all episodes; every call of a tool that has the parameter NAME
                 gets NAME = the episode's own fresh folder (the server keeps each episode's state
                 there); NAME is removed from the schemas the agent sees
  stateless      one server for all episodes: the server keeps no state between calls
"""
from __future__ import annotations

import copy
import json
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

from fastrehearse.envs.base import ResetResult, Suite, Task, ToolCall, ToolEnv, ToolResult, Trajectory
from fastrehearse.envs.mcptools.client import REGISTRY, Server, ServerStartError
from fastrehearse.envs.mcptools.tasks import check_answer, field_of, load_tasks
from fastrehearse.envs.replay import exchanges_of, final_answer_of

SYSTEM_PROMPT = ("You are a helpful assistant with access to tools. Use the tools to look up what you need "
                 "or to make changes; then reply to the user with a short final answer.")
ISOLATIONS = ("process", "reset:TOOL", "argument:NAME", "stateless")
PLACEHOLDER = "{episode_dir}"
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def clean_schema(schema: Any) -> Any:
    """A JSON schema without "title" annotations (pydantic adds one per property: prompt tokens
    that say nothing). Property *names* called "title" are kept."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: clean_schema(v) for k, v in out["properties"].items()}
    for k in ("items", "additionalProperties", "not"):
        if isinstance(out.get(k), dict):
            out[k] = clean_schema(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [clean_schema(x) for x in out[k]]
    for k in ("$defs", "definitions"):
        if isinstance(out.get(k), dict):
            out[k] = {n: clean_schema(v) for n, v in out[k].items()}
    return out


def _parse_isolation(value: str) -> tuple[str, str | None]:
    kind, _, arg = value.partition(":")
    if kind in ("process", "stateless") and not arg:
        return kind, None
    if kind in ("reset", "argument") and arg:
        return kind, arg
    raise ValueError(f"isolation={value!r}: expected one of {list(ISOLATIONS)}")


class McpTask(Task):
    """A Task whose gold trajectory is built (by calling the real server) when first read, so a
    run that never reads it (rehearse-mode RL without SFT) sends the server no call."""

    def __init__(self, id: str, split: str, payload: dict, gold_fn=None):
        super().__init__(id=id, split=split, payload=payload)
        self._gold_fn = gold_fn

    @property
    def gold(self) -> list[dict] | None:
        return self._gold_fn(self.payload) if self._gold_fn is not None else None

    @gold.setter
    def gold(self, value: list[dict] | None) -> None:
        self._gold_fn = None if value is None else (lambda _payload: value)

    def __repr__(self) -> str:
        return f"McpTask(id={self.id!r}, split={self.split!r})"


class McpEnv(ToolEnv):
    """One episode against an MCP server (module docstring). Tools fixed at reset; the engine
    checks call names and arguments against the schemas (the server checks them again)."""

    def __init__(self, suite: "McpSuite"):
        self.suite = suite
        self.task: Task | None = None
        self.tool_names: set[str] = set()
        self.server: Server | None = None       # this episode's (process) or borrowed (reset) server
        self.folder: Path | None = None
        self.calls = 0

    def reset(self, task: Task) -> ResetResult:
        self.close()
        self.task = task
        tools = self.suite.tools_for(task)
        self.tool_names = {t["function"]["name"] for t in tools}
        system = task.payload.get("system") or self.suite.system
        return ResetResult(tools=tools, messages=[{"role": "system", "content": system},
                                                  {"role": "user", "content": task.payload["prompt"]}])

    def _folder(self) -> Path:
        if self.folder is None:
            self.folder = self.suite.new_folder("episode")
        return self.folder

    def _server(self) -> Server:
        kind, arg = self.suite.isolation
        if kind == "process":
            if self.server is None:
                self.server = self.suite.make_server(self._folder())
            return self.server
        if kind == "reset":
            if self.server is None:
                self.server = self.suite.acquire()
                out = self.server.call(arg, {})
                if not out.ok:
                    raise ServerStartError(f"the reset tool {arg!r} failed: {out.text}")
            return self.server
        return self.suite.shared()

    def execute(self, call: ToolCall) -> ToolResult:
        if self.task is None:
            return ToolResult(json.dumps({"error": "environment not reset"}), ok=False, error_kind="env_error")
        if call.name not in self.tool_names:
            return ToolResult(json.dumps({"error": f"unknown tool {call.name!r}; available: {sorted(self.tool_names)}"}),
                              ok=False, error_kind="unknown_tool")
        if not isinstance(call.arguments, dict):
            return ToolResult(json.dumps({"error": f"arguments of {call.name} must be a JSON object"}),
                              ok=False, error_kind="bad_arguments")
        args = dict(call.arguments)
        kind, arg = self.suite.isolation
        if kind == "argument" and call.name in self.suite.with_episode_arg:
            if arg in args:
                return ToolResult(json.dumps({"error": f"{call.name} has no parameter {arg!r}"}), ok=False,
                                  error_kind="bad_arguments")
            args[arg] = str(self._folder())
        try:
            server = self._server()
        except ServerStartError as e:
            return ToolResult(json.dumps({"error": str(e)}), ok=False, error_kind="server_start")
        self.calls += 1
        out = server.call(call.name, args)
        return ToolResult(out.text, ok=out.ok, error_kind=out.error_kind)

    def score(self, task: Task, trajectory: Trajectory) -> float:
        c = task.payload["check"]
        return check_answer(c, final_answer_of(trajectory), c.get("value"), task.payload, trajectory)

    def close(self) -> None:
        kind, _ = self.suite.isolation
        if self.server is not None:
            if kind == "process":
                self.server.stop()
            elif kind == "reset":
                self.suite.release(self.server)
        self.server = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


class McpSuite(Suite):
    """An MCP server's tools and a task file (fastrehearse.envs.mcptools.tasks) as a suite.

    url: instead of `server`, the endpoint of a streamable-HTTP server someone else runs (isolation
        must then be stateless or argument:NAME: nothing here starts or stops it).
    server: the stdio command, a list (or one string split on spaces); run in `config_dir`. A
        first word "python" / "python3" is this process's own interpreter (sys.executable), so
        the server sees the packages the trainer sees.
    tasks: the task file (JSON lines), relative to `config_dir`.
    isolation: process | reset:TOOL | argument:NAME | stateless (module docstring).
    side_effect_free: the server's real calls cost nothing and change nothing outside the episode:
        the trainer then measures fidelity by default as for the built-in suites (off otherwise).
    call_timeout / start_timeout: seconds; a call over its limit is the call's error text.
    env: extra environment variables of the server (it inherits only a safe default set).
    system: the system prompt (a task's "system" overrides it); tools: the tool names shown to
        the agent (default: all the server lists; a task's "tools" narrows them further).
    with_gold: a task's gold trajectory (SFT, `--policy gold`) replays its gold_calls against
        the real server when first read (never read: never called).
    config_dir: the folder relative paths are resolved against (the trainer passes the config
        file's folder; default: the working directory).
    """
    name = "mcp"
    reward_modes = ("real", "consistent", "calls")

    def __init__(self, server: list[str] | str | None = None, tasks: str = "tasks.jsonl", url: str | None = None,
                 isolation: str | None = None, side_effect_free: bool = False, call_timeout: float = 30.0,
                 start_timeout: float = 30.0, env: dict | None = None, system: str | None = None,
                 tools: list[str] | None = None, with_gold: bool = True, config_dir: str | None = None):
        if isinstance(server, str):
            server = server.split()
        if (server is None) == (url is None):
            raise ValueError("server / url: give exactly one (a stdio command, or the url of a running "
                             "streamable-HTTP server)")
        self.url = url
        if url is not None:
            if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
                raise ValueError(f"url: an http(s) URL such as http://127.0.0.1:8000/mcp, got {url!r}")
            if isolation is None or isolation.partition(":")[0] not in ("stateless", "argument"):
                raise ValueError(f"isolation={isolation!r}: with url (one server that others run) episodes are "
                                 f"isolated only by the server: say isolation: stateless or argument:NAME")
            server = [url]
        if not (isinstance(server, list) and server and all(isinstance(x, (str, int, float)) for x in server)):
            raise ValueError(f"server: a stdio command as a list, e.g. [python, my_server.py], got {server!r}")
        self.command = [str(x) for x in server]
        if url is None and self.command[0] in ("python", "python3"):   # the trainer's own interpreter
            self.command[0] = sys.executable
        for k, v in (("call_timeout", call_timeout), ("start_timeout", start_timeout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{k}: seconds > 0, got {v!r}")
        self.call_timeout, self.start_timeout = float(call_timeout), float(start_timeout)
        self.isolation = _parse_isolation(isolation or "process")
        self.side_effect_free = bool(side_effect_free)
        if env is not None and not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            raise ValueError(f"env: a mapping of environment variables to strings, got {env!r}")
        self.env = {str(k): v for k, v in (env or {}).items()}
        self.system = system or SYSTEM_PROMPT
        self.with_gold = bool(with_gold)
        self.dir = Path(config_dir or ".").resolve()
        self.rows = load_tasks(self.dir / tasks)
        self._lock = threading.Lock()
        self._shared: Server | None = None
        self._idle: list[Server] = []
        self._gold: dict[str, list[dict] | None] = {}
        self._read_schemas(tools)

    # -- servers ---------------------------------------------------------------------------------
    def new_folder(self, kind: str) -> Path:
        d = REGISTRY.scratch() / f"{kind}-{REGISTRY.next_id()}"
        d.mkdir(parents=True)
        return d

    def make_server(self, folder: Path) -> Server:
        """A server (not started) whose "{episode_dir}" is `folder`."""
        if self.url is not None:
            return Server(url=self.url, call_timeout=self.call_timeout, start_timeout=self.start_timeout)
        cmd = [x.replace(PLACEHOLDER, str(folder)) for x in self.command]
        return Server(cmd, cwd=str(self.dir), env=self.env, call_timeout=self.call_timeout,
                      start_timeout=self.start_timeout, log=folder / "server.stderr")

    def shared(self) -> Server:
        with self._lock:
            if self._shared is None:
                self._shared = self.make_server(self.new_folder("shared"))
            return self._shared

    def acquire(self) -> Server:
        with self._lock:
            return self._idle.pop() if self._idle else self.make_server(self.new_folder("pooled"))

    def release(self, server: Server) -> None:
        with self._lock:
            self._idle.append(server)

    def close(self) -> None:
        """Stop this suite's shared and pooled servers (atexit does it too)."""
        with self._lock:
            servers, self._idle = [self._shared, *self._idle], []
            self._shared = None
        for s in servers:
            if s is not None:
                s.stop()

    def _read_schemas(self, only: list[str] | None) -> None:
        """tools/list once, on a server of its own (stopped after): a server that cannot start is
        refused here, before any model loads."""
        probe = self.make_server(self.new_folder("schemas"))
        try:
            listed = probe.list_tools()
        except ServerStartError as e:
            raise ValueError(str(e)) from None
        finally:
            probe.stop()
        kind, arg = self.isolation
        self.schemas: dict[str, dict] = {}
        self.output_schemas: dict[str, dict | None] = {}
        self.input_schemas: dict[str, dict] = {}
        self.with_episode_arg: set[str] = set()     # argument:NAME: the tools that take NAME
        names = [t.name for t in listed]
        if kind == "reset" and arg not in names:
            raise ValueError(f"isolation=reset:{arg}: the server has no tool {arg!r}; it lists {names}")
        for t in listed:
            if kind == "reset" and t.name == arg:
                continue
            params = clean_schema(copy.deepcopy(t.input_schema or {"type": "object", "properties": {}}))
            props = params.get("properties") or {}
            if kind == "argument" and arg in props:
                self.with_episode_arg.add(t.name)
                props.pop(arg)
                params["required"] = [r for r in params.get("required", []) if r != arg]
                if not params["required"]:
                    params.pop("required")
            self.input_schemas[t.name] = params
            self.output_schemas[t.name] = t.output_schema
            self.schemas[t.name] = {"type": "function", "function": {
                "name": t.name, "description": (t.description or "").strip(), "parameters": params}}
        if kind == "argument" and not self.with_episode_arg:
            raise ValueError(f"isolation=argument:{arg}: no tool of the server has a parameter {arg!r}")
        if only is not None:
            missing = [n for n in only if n not in self.schemas]
            if missing:
                raise ValueError(f"tools: the server lists no tool {missing}; it lists {sorted(self.schemas)}")
            self.schemas = {n: self.schemas[n] for n in only}
        for row in self.rows:
            bad = [n for n in row.get("tools", []) if n not in self.schemas]
            bad += [g["name"] for g in row["gold_calls"] if g["name"] not in self.schemas]
            src = (row["check"].get("source") or {}).get("tool")
            bad += [src] if src is not None and src not in self.schemas else []
            if bad:
                raise ValueError(f"tasks: task {row['id']!r} names tool(s) {sorted(set(bad))} the server does not "
                                 f"expose; it exposes {sorted(self.schemas)}")

    # -- Suite -------------------------------------------------------------------------------------
    def tools_for(self, task: Task) -> list[dict]:
        names = task.payload.get("tools") or list(self.schemas)
        return [copy.deepcopy(self.schemas[n]) for n in names]

    def splits(self) -> list[str]:
        return sorted({r["split"] for r in self.rows})

    def tasks(self, split: str, limit: int | None = None) -> list[Task]:
        if split not in self.splits():
            raise ValueError(f"split={split!r}: the task file has splits {self.splits()}")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit={limit!r}: expected an int >= 0 or None")
        rows = [r for r in self.rows if r["split"] == split][:limit]
        return [McpTask(r["id"], split, r, self.gold if self.with_gold else None) for r in rows]

    def gold(self, row: dict) -> list[dict] | None:
        """The gold trajectory: each gold call executed against the real server in a fresh
        episode, then a final answer (check.value). None without gold calls or without a value
        to answer (regex / function checks). A gold call that fails is a task-file error."""
        if row["id"] in self._gold:
            return self._gold[row["id"]]
        c = row["check"]
        if not row["gold_calls"] or "value" not in c or c["type"] in ("regex", "function"):
            self._gold[row["id"]] = None
            return None
        env = self.make_env()
        task = Task(id=row["id"], split=row["split"], payload=row)
        msgs: list[dict] = []
        try:
            env.reset(task)
            for g in row["gold_calls"]:
                args = g.get("arguments", {})
                res = env.execute(ToolCall(g["name"], args))
                if not res.ok:
                    raise ValueError(f"tasks: task {row['id']!r}: gold call {g['name']}({json.dumps(args)}) "
                                     f"failed on the real server: {res.content}")
                msgs += [{"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": g["name"], "arguments": copy.deepcopy(args)}}]},
                         {"role": "tool", "name": g["name"], "content": res.content}]
        finally:
            env.close()
        value = c["value"]
        answer = value if isinstance(value, str) else json.dumps(value)
        if c["type"] == "number" and float(value).is_integer():
            answer = str(int(value))
        msgs.append({"role": "assistant", "content": answer})
        found, got = self._source_value(msgs, c["source"]) if c.get("source") else (False, None)
        if found:     # the task's value agrees with the real response it is copied from
            if check_answer(c, got if isinstance(got, str) else json.dumps(got), value) < 1:
                raise ValueError(f"tasks: task {row['id']!r}: check.value {value!r} but the real response of "
                                 f"{c['source']['tool']} has {c['source']['field']} = {got!r}")
        self._gold[row["id"]] = msgs
        return msgs

    def make_env(self) -> McpEnv:
        return McpEnv(self)

    def response_spec(self, tool: str) -> dict | None:
        out = self.output_schemas.get(tool)
        props = (out or {}).get("properties")
        if not isinstance(props, dict):
            return None
        inputs = (self.input_schemas.get(tool) or {}).get("properties") or {}
        return {"keys": list(props), "echo": {k: k for k in props if k in inputs}}

    @classmethod
    def costly_calls(cls, options: dict) -> bool:
        return not options.get("side_effect_free", False)

    # -- rewards ------------------------------------------------------------------------------------
    @staticmethod
    def _source_value(messages: list[dict], source: dict) -> tuple[bool, Any]:
        """The source field of the last successful response of source.tool in `messages`."""
        for ex in reversed(exchanges_of(messages)):
            if ex.name != source["tool"] or ex.content is None:
                continue
            try:
                obj = json.loads(ex.content)
            except ValueError:
                continue
            if isinstance(obj, dict) and "error" in obj and len(obj) == 1:
                continue
            found, value = field_of(obj, source["field"])
            if found:
                return True, value
        return False, None

    def task_reward(self, task: Task, trajectory: Trajectory, mode: str) -> float:
        c = task.payload["check"]
        if mode == "consistent":
            if not c.get("source"):
                raise ValueError(f"task {task.id!r} has no check.source: 'consistent' cannot grade it")
            found, value = self._source_value(trajectory.messages, c["source"])
            if not found:
                return 0.0
            check = c if c["type"] in ("exact", "number", "contains") else {"type": "contains"}
            return check_answer(check, final_answer_of(trajectory), value)
        if mode == "calls":
            made = [(ex.name, ex.arguments) for ex in exchanges_of(trajectory.messages)]
            return float(all((g["name"], g.get("arguments", {})) in made for g in task.payload["gold_calls"]))
        return super().task_reward(task, trajectory, mode)

    def check_reward(self, mode: str, tasks: list[Task]) -> None:
        need = {"consistent": ("source", lambda t: bool(t.payload["check"].get("source"))),
                "calls": ("gold_calls", lambda t: bool(t.payload["gold_calls"]))}.get(mode)
        if need is None:
            return
        bad = [t.id for t in tasks if not need[1](t)]
        if bad:
            what = "check.source" if need[0] == "source" else "gold_calls"
            raise ValueError(f"{len(bad)} train task(s) have no {what} (first: {bad[0]!r}); {mode!r} grades "
                             f"{'against the source field of the episode own response' if mode == 'consistent' else 'the gold calls'}"
                             f": add it to every task or use env.reward=real")
