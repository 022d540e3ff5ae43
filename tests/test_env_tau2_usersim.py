"""tau2 conversational mode (mock, airline) against a scripted OpenAI-compatible user simulator on
loopback: tau2's UserSimulator talks to it through litellm, tau2's evaluator scores the run."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("tau2")

from fastrehearse.envs.base import ToolCall, Trajectory  # noqa: E402
from fastrehearse.envs.tau2 import Tau2Suite  # noqa: E402


class ScriptedUser:
    """Answers chat completions with the next scripted line; records what it was sent."""

    def __init__(self, lines: list[str]):
        self.lines, self.requests = list(lines), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                text = outer.lines.pop(0) if outer.lines else "###STOP###"
                data = json.dumps({
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def user_sim(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    sim = ScriptedUser(["Hi, I need help with my reservation.", "###STOP###"])
    yield sim
    sim.close()


def test_conversation_scored_by_tau2(user_sim):
    """Full flow on tau2's mock domain in conversational mode (small DB: fast)."""
    suite = Tau2Suite(user_url=user_sim.url, user_model="openai/scripted-user", solo=False)
    task = suite.tasks("mock", limit=1)[0]
    assert task.id == "mock/create_task_1"
    env = suite.make_env()
    res = env.reset(task)
    assert [m["role"] for m in res.messages] == ["system", "assistant", "user"]
    assert res.messages[-1]["content"] == "Hi, I need help with my reservation."
    # The simulator was prompted with tau2's user instructions for this task.
    path, body = user_sim.requests[0]
    assert path.endswith("/chat/completions") and body["model"] == "scripted-user"
    instructions = task.payload["tau2_task"].user_scenario.instructions
    assert str(instructions)[:40] in body["messages"][0]["content"]

    traj = Trajectory()
    gold = [m for m in task.gold if m["role"] != "user"]
    for m in gold:
        if m["role"] == "tool":
            continue
        traj.messages.append(m)
        for tc in m.get("tool_calls") or []:
            r = env.execute(ToolCall(tc["function"]["name"], tc["function"]["arguments"]))
            assert r.ok, r
            traj.messages.append({"role": "tool", "name": tc["function"]["name"], "content": r.content})
    # The agent's closing reply goes to the simulated user, who ends the chat.
    assert env.next_user_message(traj.messages[-1]) is None
    assert env.user_stopped and env.finished
    assert user_sim.requests[-1][1]["messages"][-1]["content"] == gold[-1]["content"]
    assert env.score(task, traj) == 1.0
    # Same conversation without the create_task call: tau2's DB check fails.
    talk_only = Trajectory(messages=[m for m in traj.messages if m["role"] == "assistant" and not m.get("tool_calls")])
    assert env.score(task, talk_only) == 0.0
    # A run the user never ended (no stop seen) is premature in tau2: 0. The gold record ends
    # with the user's stop message, which counts when it is in the trajectory.
    assert suite.make_env().score(task, traj) == 0.0
    closed = Trajectory(messages=traj.messages + [{"role": "user", "content": "###STOP###"}])
    assert suite.make_env().score(task, closed) == 1.0


def test_airline_runs_with_an_endpoint(user_sim):
    suite = Tau2Suite(user_url=user_sim.url, user_model="openai/scripted-user")
    task = suite.tasks("airline", limit=1)[0]
    res = suite.make_env().reset(task)
    assert res.messages[-1] == {"role": "user", "content": "Hi, I need help with my reservation."}
    names = {s["function"]["name"] for s in res.tools}
    assert {"book_reservation", "cancel_reservation", "transfer_to_human_agents"} <= names
