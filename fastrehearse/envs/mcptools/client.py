"""A synchronous handle on one MCP server process (stdio), for the synchronous episode engine.

The MCP SDK is async (anyio). Every server of this process is driven from one background thread
running an asyncio loop (`_loop()`); a `Server` keeps its `stdio_client` + `ClientSession` open in
one task of that loop (anyio's cancel scopes must be entered and left in the same task) and the
engine's thread submits requests to it with `asyncio.run_coroutine_threadsafe`, waiting at most the
call timeout. Nothing here raises for a tool's failure: `call` returns a `CallOutcome` whose text is
what the agent sees.

Life of a server: started when first needed (`start`), restarted by the next call after it crashed,
stopped by `stop` (closing stdin, then terminate / kill: the SDK's shutdown), by `atexit`, and --
when this process dies without running any code (SIGKILL, the OOM killer, a SIGTERM without a
handler) -- by a watchdog process (fastrehearse/envs/mcptools/watchdog.py): it is
told the pids of the live servers and terminates them, and removes this process's scratch folder,
once this process is gone. Servers run in their own session (the SDK starts them so), so a signal to
the trainer's process group does not reach them: the watchdog and `atexit` are what stop them.
"""
from __future__ import annotations

import asyncio
import atexit
import builtins
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

MARKER = "FASTREHEARSE_MCP_SERVER_ID"   # set in each server's environment to find its pid
# The watchdog script: stdlib + psutil, run by path (it imports nothing of ours).
WATCHDOG = Path(__file__).resolve().with_name("watchdog.py")
_GROUP = getattr(builtins, "BaseExceptionGroup", None)   # Python >= 3.11 (anyio raises groups)


class ServerStartError(RuntimeError):
    """The server could not start or did not answer `initialize` (one line, naming the command)."""


@dataclass
class CallOutcome:
    text: str                     # the tool-response text the agent sees
    ok: bool
    error_kind: str | None = None  # "tool_error" | "timeout" | "server_crashed" | "server_start"


# ---- the background event loop -----------------------------------------------------------------
_LOCK = threading.Lock()
_LOOP: asyncio.AbstractEventLoop | None = None


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="fastrehearse-mcp", daemon=True).start()
            _LOOP = loop
        return _LOOP


def _run(coro, timeout: float | None):
    """Run `coro` on the background loop from a synchronous caller; FutureTimeout after `timeout`
    (the coroutine is cancelled then)."""
    fut = asyncio.run_coroutine_threadsafe(coro, _loop())
    try:
        return fut.result(timeout)
    except FutureTimeout:
        fut.cancel()
        raise


# ---- scratch folder and watchdog (one per process) ----------------------------------------------
class _Registry:
    """This process's live servers, scratch folder and watchdog."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.servers: set[Server] = set()
        self.root: Path | None = None
        self.watchdog: subprocess.Popen | None = None
        self.pid = os.getpid()
        self.ids = itertools.count()

    def next_id(self) -> int:
        return next(self.ids)

    def scratch(self) -> Path:
        """This process's scratch folder (per-episode folders, server logs); removed at exit."""
        with self.lock:
            self._fork_check()
            if self.root is None:
                self.root = Path(tempfile.mkdtemp(prefix="fastrehearse-mcp-"))
            return self.root

    def _fork_check(self) -> None:
        if self.pid != os.getpid():   # a forked child: the parent's servers and watchdog are not ours
            self.__init__()

    def add(self, server: "Server") -> None:
        with self.lock:
            self._fork_check()
            self.servers.add(server)
            self._tell()

    def remove(self, server: "Server") -> None:
        with self.lock:
            self.servers.discard(server)
            self._tell()

    def _tell(self) -> None:
        if self.watchdog is None or self.watchdog.poll() is not None:
            if not self.servers:
                return
            if self.root is None:
                self.root = Path(tempfile.mkdtemp(prefix="fastrehearse-mcp-"))
            self.watchdog = subprocess.Popen([sys.executable, "-I", str(WATCHDOG), str(os.getpid()), str(self.root)],
                                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                             start_new_session=True)
        pids = sorted(s.pid for s in self.servers if s.pid is not None)
        try:   # "engine PID ...": the processes to stop (with their descendants) if this one dies
            self.watchdog.stdin.write(f"engine {' '.join(map(str, pids))}\n".encode())
            self.watchdog.stdin.flush()
        except (OSError, ValueError):
            pass

    def shutdown(self) -> None:
        """atexit: stop every server, then the watchdog (which removes the scratch folder)."""
        if self.pid != os.getpid():
            return
        for s in list(self.servers):
            s.stop()
        with self.lock:
            if self.watchdog is not None and self.watchdog.poll() is None:
                try:
                    self.watchdog.stdin.write(b"stop\n")
                    self.watchdog.stdin.close()
                    self.watchdog.wait(timeout=10)
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    self.watchdog.kill()
            if self.root is not None:
                shutil.rmtree(self.root, ignore_errors=True)


REGISTRY = _Registry()
atexit.register(REGISTRY.shutdown)


# ---- one server ---------------------------------------------------------------------------------
def _describe(command: list[str]) -> str:
    return "[" + ", ".join(command) + "]"


def content_text(result) -> str:
    """A CallToolResult as the text of a tool response: the structured result as compact JSON when
    the server sent one, else its content blocks joined (non-text blocks described in one line:
    the agent reads text)."""
    if result.structured_content is not None and not result.is_error:
        return json.dumps(result.structured_content, separators=(",", ":"), ensure_ascii=False)
    parts = []
    blocks = list(result.content or [])
    for c in blocks:
        kind = getattr(c, "type", None)
        if kind == "text":
            parts.append(_compact(c.text) if len(blocks) == 1 else c.text)
        elif kind in ("image", "audio"):
            n = len(c.data) * 3 // 4
            parts.append(f"[{kind} content: {c.mime_type}, about {n} bytes, not shown]")
        elif kind == "resource":
            res = c.resource
            text = getattr(res, "text", None)
            parts.append(text if isinstance(text, str) else
                         f"[resource {res.uri} ({getattr(res, 'mime_type', None) or 'binary'}), not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {c.uri}]")
        else:
            parts.append(f"[{kind} content, not shown]")
    return "\n".join(parts)


def _compact(text: str) -> str:
    """A text block that is a JSON object or array, as compact JSON (servers indent theirs: the SDK
    does for a returned dict without an output schema); any other text unchanged."""
    if not text.lstrip().startswith(("{", "[")):
        return text
    try:
        return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError):
        return text


class Server:
    """One MCP server process and its client session (module docstring)."""

    def __init__(self, command: list[str] | None = None, *, url: str | None = None, cwd: str | None = None,
                 env: dict[str, str] | None = None, call_timeout: float = 30.0, start_timeout: float = 30.0,
                 log: Path | None = None):
        if bool(command) == bool(url):
            raise ValueError("server: a stdio command or a url (streamable HTTP), exactly one")
        self.url = url                  # a server someone else runs: nothing to start or stop but the session
        self.command = list(command) if command else [url]
        self.cwd, self.env = cwd, dict(env or {})
        self.call_timeout, self.start_timeout = call_timeout, start_timeout
        self.log = log
        self.session = None
        self.pid: int | None = None
        self.crashed: str | None = None     # why the last session ended unexpectedly
        self.starts = 0
        self._task: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None

    @property
    def alive(self) -> bool:
        return self.session is not None and self.crashed is None

    # -- start / stop -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the process and initialize the session; ServerStartError (one line) otherwise."""
        if self.alive:
            return
        self.stop()
        self.crashed = None
        marker = uuid.uuid4().hex
        try:
            _run(self._open(marker), self.start_timeout)
        except FutureTimeout:
            self.stop()
            raise ServerStartError(f"MCP server {_describe(self.command)} did not answer initialize within "
                                   f"{self.start_timeout:g} s{self._stderr_tail()}") from None
        except BaseException as e:   # noqa: BLE001 - any start failure is one line naming the command
            self.stop()
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if _GROUP and isinstance(e, _GROUP):
                msg = "; ".join(str(x).strip().splitlines()[0] if str(x).strip() else type(x).__name__
                                for x in _leaves(e))
            raise ServerStartError(f"MCP server {_describe(self.command)} could not start: {msg}"
                                   f"{self._stderr_tail()}") from None
        self.starts += 1
        if not self.url:
            self.pid = _child_with_marker(marker)
            REGISTRY.add(self)

    async def _open(self, marker: str) -> None:
        ready = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._serve(marker, ready))
        await ready

    async def _serve(self, marker: str, ready: asyncio.Future) -> None:
        # The MCP SDK (about 0.5 s to import) is imported here and in list_tools, where a server is
        # talked to: loading the suite (config checks, --help) does not pay for it.
        from mcp import ClientSession, StdioServerParameters, stdio_client
        errlog = open(self.log, "a") if self.log else open(os.devnull, "w")
        if self.url:
            from mcp.client.streamable_http import streamable_http_client
            transport = streamable_http_client(self.url)
        else:
            transport = stdio_client(StdioServerParameters(command=self.command[0], args=self.command[1:], cwd=self.cwd,
                                                           env={**self.env, MARKER: marker}), errlog=errlog)
        try:
            async with transport as (r, w, *_):
                async with ClientSession(r, w) as session:
                    await session.initialize()
                    self.session = session
                    ready.set_result(None)
                    await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported through `ready` or `crashed`
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            elif self.crashed is None and not self._stop.is_set():
                self.crashed = f"{type(e).__name__}: {e}"
        finally:
            self.session = None
            errlog.close()

    def stop(self) -> None:
        """Close the session and stop the process (idempotent, never raises)."""
        task, stop = self._task, self._stop
        self._task = None
        if task is not None and not task.done():
            async def _close():
                stop.set()
                try:
                    await asyncio.wait_for(asyncio.shield(task), 10)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                    task.cancel()
            try:
                _run(_close(), 15)
            except Exception:  # noqa: BLE001 - the watchdog / kill below remain
                pass
        if self.pid is not None:
            _kill_if_alive(self.pid)
        self.session = None
        REGISTRY.remove(self)
        self.pid = None

    def _stderr_tail(self) -> str:
        if not self.log:
            return ""
        try:
            lines = [x.strip() for x in Path(self.log).read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return f"; its stderr ends: {lines[-1][:300]}" if lines else ""

    # -- requests ---------------------------------------------------------------------------------
    def list_tools(self) -> list:
        self.start()
        out, cursor = [], None

        async def page(c):
            from mcp.types import PaginatedRequestParams
            return await self.session.list_tools(params=PaginatedRequestParams(cursor=c) if c else None)
        while True:
            res = _run(page(cursor), self.call_timeout)
            out += list(res.tools)
            cursor = getattr(res, "next_cursor", None)
            if not cursor:
                return out

    def call(self, name: str, arguments: dict[str, Any]) -> CallOutcome:
        """One tools/call. A crashed server is restarted first (its state is gone: the outcome of
        a later call says so only through the tool's own answers). Never raises."""
        if not self.alive:     # first call (lazy start), or the server crashed before
            try:
                self.start()
            except ServerStartError as e:
                return CallOutcome(json.dumps({"error": str(e)}), False, "server_start")
        session = self.session
        timeout = self.call_timeout

        async def go():
            return await session.call_tool(name, arguments, read_timeout_seconds=timeout)
        try:
            res = _run(go(), timeout + 5)
        except FutureTimeout:
            return self._timeout(name)
        except Exception as e:  # noqa: BLE001 - the SDK's MCPError and transport failures
            text = str(e)
            if "timed out" in text.lower():
                return self._timeout(name)
            if self._process_gone() or "connection closed" in text.lower():
                self.crashed = self.crashed or text or type(e).__name__
                self.stop()
                return CallOutcome(json.dumps({"error": f"the tool server {'connection closed' if self.url else 'crashed'} during {name} "
                                                        f"({self.crashed}); it is restarted at the next call "
                                                        f"(what it held in memory is lost)"}), False, "server_crashed")
            return CallOutcome(json.dumps({"error": f"{name}: {text or type(e).__name__}"}), False, "tool_error")
        text = content_text(res)
        if res.is_error:
            return CallOutcome(json.dumps({"error": text}, ensure_ascii=False), False, "tool_error")
        return CallOutcome(text, True)

    def _timeout(self, name: str) -> CallOutcome:
        return CallOutcome(json.dumps({"error": f"timeout: the tool server did not answer {name} within "
                                                f"{self.call_timeout:g} s"}), False, "timeout")

    def _process_gone(self) -> bool:
        if self.url or self.pid is None:
            return self.session is None
        try:
            p = psutil.Process(self.pid)
            return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
        except Exception:  # noqa: BLE001 - psutil.NoSuchProcess and friends
            return True


def _leaves(group: BaseException):
    if _GROUP and isinstance(group, _GROUP):
        for e in group.exceptions:
            yield from _leaves(e)
    else:
        yield group


def _child_with_marker(marker: str) -> int | None:
    """The pid of this process's child started with MARKER=marker in its environment."""
    for c in psutil.Process().children():
        try:
            if c.environ().get(MARKER) == marker:
                return c.pid
        except psutil.Error:
            continue
    return None


def _kill_if_alive(pid: int) -> None:
    """After a graceful stop the process is gone; a straggler (and its children) is killed."""
    try:
        p = psutil.Process(pid)
        if p.environ().get(MARKER) is None:   # a reused pid: not ours
            return
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return
    for q in procs:
        try:
            q.kill()
        except psutil.Error:
            pass
