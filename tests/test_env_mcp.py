"""The `mcp` suite against the real example server (examples/mcp_inventory/server.py, MCP SDK over
stdio; no mock): schemas from tools/list, real calls, rehearsed calls that never reach the server
(its call log), per-episode isolation, crash mid-episode, timeout, an MCP error result, non-text
content, a server that cannot start, no orphan server after the owner exits / is SIGTERMed /
SIGKILLed, the consistent reward and its refusal, fidelity defaults, and `fastrehearse train`."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import yaml

from fastrehearse.envs import ToolCall, Trajectory, get_suite, replay_gold
from fastrehearse.envs.mcptools import client
from fastrehearse.train.config import ConfigError, load_config

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mcp_inventory"
SERVER = [sys.executable, str(EXAMPLE / "server.py"), "--db", "{episode_dir}/inventory.sqlite"]


def log_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def inventory(log: Path, **options):
    return get_suite("mcp", server=SERVER + ["--log", str(log), "--faults"], tasks=str(EXAMPLE / "tasks.jsonl"),
                     **options)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    log = tmp_path_factory.mktemp("mcp") / "calls.jsonl"
    s = inventory(log, call_timeout=2.0, isolation="reset:reset")   # a pool: 222 gold replays in seconds
    yield s, log
    s.close()


def test_schemas_come_from_list_tools(suite):
    s, log = suite
    names = set(s.schemas)
    assert {"find_item", "get_item", "add_stock", "remove_stock", "set_price", "category_value"} <= names
    get = s.schemas["get_item"]["function"]
    assert get["description"].startswith("An item's name, category")
    assert get["parameters"] == {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}
    # outputSchema -> the world-model reward's response format; a tool without one has none
    assert s.response_spec("get_item") == {"keys": ["sku", "name", "category", "stock", "price"],
                                           "echo": {"sku": "sku"}}
    assert s.response_spec("reset") is None
    assert log_lines(log) == []          # reading the schemas calls no tool


def test_real_calls_and_every_gold_trajectory(suite):
    s, log = suite
    tasks = s.tasks("train") + s.tasks("test")
    assert len(tasks) == 111 and len(s.tasks("test")) == 20
    env = s.make_env()
    env.reset(tasks[0])
    r = env.execute(ToolCall("get_item", {"sku": "SK201"}))
    assert r.ok and json.loads(r.content) == {"sku": "SK201", "name": "hammer", "category": "tools",
                                              "stock": 22, "price": 14.5}
    env.close()
    assert log_lines(log)[-1]["tool"] == "get_item"
    for t in tasks:      # gold calls replayed on the real server reach the checked value
        res = replay_gold(s, t)
        assert res.score == 1.0 and res.mismatches == [], t.id


def test_errors_nontext_crash_and_timeout_are_the_calls_text(suite):
    s, _ = suite
    env = s.make_env()
    env.reset(s.tasks("train", limit=1)[0])
    err = env.execute(ToolCall("get_item", {"sku": "nope"}))           # an MCP error result
    assert not err.ok and err.error_kind == "tool_error" and "unknown sku 'nope'" in json.loads(err.content)["error"]
    pic = env.execute(ToolCall("picture", {}))                          # non-text content
    assert pic.ok and pic.content.startswith("[image content: image/png")
    assert env.execute(ToolCall("add_stock", {"sku": "SK204", "quantity": 1})).content == '{"sku":"SK204","stock":10}'
    pid = env.server.pid
    crash = env.execute(ToolCall("crash", {}))                         # the server dies mid-episode
    assert not crash.ok and crash.error_kind == "server_crashed" and "restarted" in crash.content
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    again = env.execute(ToolCall("get_item", {"sku": "SK204"}))        # the episode goes on
    assert again.ok and env.server.pid != pid and env.server.starts == 2
    t0 = time.monotonic()
    slow = env.execute(ToolCall("slow", {"seconds": 30}))               # call_timeout = 2 s
    assert time.monotonic() - t0 < 10
    assert not slow.ok and slow.error_kind == "timeout" and "did not answer slow within 2 s" in slow.content
    assert env.execute(ToolCall("get_item", {"sku": "SK101"})).ok
    env.close()
    assert env.server is None


def test_episodes_are_isolated(tmp_path):
    for isolation in ("process", "reset:reset"):
        s = inventory(tmp_path / f"{isolation}.jsonl", isolation=isolation)
        a, b = s.make_env(), s.make_env()
        task = s.tasks("train", limit=1)[0]
        a.reset(task)
        b.reset(task)
        assert a.execute(ToolCall("add_stock", {"sku": "SK204", "quantity": 5})).content == '{"sku":"SK204","stock":14}'
        assert json.loads(b.execute(ToolCall("get_item", {"sku": "SK204"})).content)["stock"] == 9
        a.close()
        b.close()
        c = s.make_env()          # reset: a pooled server is reset before its next episode
        c.reset(task)
        assert json.loads(c.execute(ToolCall("get_item", {"sku": "SK204"})).content)["stock"] == 9
        c.close()
        if isolation == "reset:reset":
            assert "reset" not in {t["function"]["name"] for t in c.reset(task).tools}
            assert [x["tool"] for x in log_lines(tmp_path / f"{isolation}.jsonl")].count("reset") == 3
        s.close()


def _engine_rollout(s, mode, measure_fidelity=False):
    from fastrehearse.rollout import RolloutConfig, RolloutEngine
    from fastrehearse.rollout.engine.policy import ScriptedPolicy
    from fastrehearse.rollout.text.template import assistant_text
    from _rollout_fixtures import smollm2_tokenizer, tiny_llama
    tok = smollm2_tokenizer()
    call = assistant_text({"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_item", "arguments": {"sku": "SK201"}}}]})
    eng = RolloutEngine(tiny_llama(len(tok)), tok, RolloutConfig(mode=mode, max_new_tokens=8, max_turns=1,
                                                                 max_episode_tokens=2048,
                                                                 measure_fidelity=measure_fidelity))
    return eng.rollout(s.tasks("train", limit=2), s, group_size=2, policy=ScriptedPolicy([call]))


def test_rehearsed_calls_never_reach_the_server(tmp_path):
    log = tmp_path / "calls.jsonl"
    s = inventory(log)
    before = set(client.REGISTRY.servers)
    res = _engine_rollout(s, "rehearse")
    modes = [c["mode"] for e in res.episodes for c in e.metadata["calls"]]
    assert modes == ["rehearse"] * 4
    assert log_lines(log) == [] and set(client.REGISTRY.servers) == before   # no call, no server started
    res = _engine_rollout(s, "real")
    assert [c["mode"] for e in res.episodes for c in e.metadata["calls"]] == ["real"] * 4
    assert [x["tool"] for x in log_lines(log)] == ["get_item"] * 4
    assert set(client.REGISTRY.servers) == before     # per-episode servers stopped with their episodes
    # fidelity measurement executes each rehearsed call for real and scores the rehearsed response
    res = _engine_rollout(s, "rehearse", measure_fidelity=True)
    fid = [f for e in res.episodes for f in e.metadata["fidelity"]]
    assert [f["tool"] for f in fid] == ["get_item"] * 4 and all(0 <= f["field_f1"] <= 1 for f in fid)
    assert [x["tool"] for x in log_lines(log)] == ["get_item"] * 8
    s.close()


def test_a_server_that_cannot_start_is_refused_in_one_line(tmp_path):
    for server, want in (([sys.executable, str(tmp_path / "no_such_server.py")], "could not start"),
                         (["no-such-executable-xyz"], "could not start"),
                         ([sys.executable, "-c", "import time; time.sleep(60)"], "did not answer initialize")):
        with pytest.raises(ValueError) as e:
            get_suite("mcp", server=server, tasks=str(EXAMPLE / "tasks.jsonl"), start_timeout=3)
        msg = str(e.value)
        assert "\n" not in msg and want in msg and f"MCP server [{', '.join(server)}]" in msg, msg
    cfg = load_config(None, ["env.suite=mcp", f"env.options.server=[{sys.executable}, {tmp_path}/none.py]",
                             f"env.options.tasks={EXAMPLE}/tasks.jsonl"])
    from fastrehearse.train.tasks import build_tasks
    with pytest.raises(ConfigError, match=r"config key 'env.options' \(suite 'mcp'\): MCP server \[") as e:
        build_tasks(cfg)
    assert "\n" not in str(e.value) and "none.py" in str(e.value)


OWNER = textwrap.dedent("""
    import sys, time
    from fastrehearse.envs import ToolCall, get_suite
    s = get_suite("mcp", server=[sys.executable, {server!r}, "--db", "{{episode_dir}}/i.sqlite"], tasks={tasks!r})
    env = s.make_env()
    env.reset(s.tasks("train", limit=1)[0])
    assert env.execute(ToolCall("get_item", {{"sku": "SK101"}})).ok
    from fastrehearse.envs.mcptools.client import REGISTRY
    print(env.server.pid, REGISTRY.root, flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)
    time.sleep(120)
""")


@pytest.mark.parametrize("how", ["exit", "sigterm", "sigkill"])
def test_no_orphan_server_when_the_owner_ends(tmp_path, how):
    script = tmp_path / "owner.py"
    script.write_text(OWNER.format(server=str(EXAMPLE / "server.py"), tasks=str(EXAMPLE / "tasks.jsonl")))
    p = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = p.stdout.readline().split()
    assert line, "the owner did not start its server"
    pid, root = int(line[0]), Path(line[1])
    server = psutil.Process(pid)
    assert server.is_running() and root.is_dir()
    if how != "exit":
        p.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    p.wait(timeout=60)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (server.is_running() and server.status() != psutil.STATUS_ZOMBIE
                                           or root.exists()):
        time.sleep(0.1)
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    assert not root.exists()


def test_consistent_reward_grades_against_the_episode_own_response(suite):
    s, _ = suite
    task = next(t for t in s.tasks("train") if t.id == "stock-SK201")
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_item", "arguments": {"sku": "SK201"}}}]}
    rehearsed = {"role": "tool", "content": '{"sku":"SK201","name":"hammer","stock":7,"price":1}', "rehearsed": True}
    traj = Trajectory(messages=[call, rehearsed, {"role": "assistant", "content": "There are 7."}],
                      final_answer="There are 7.")
    assert s.task_reward(task, traj, "consistent") == 1.0
    assert s.make_env().score(task, traj) == 0.0              # real: the true stock is 22
    assert s.task_reward(task, traj, "calls") == 0.0          # find_item (a gold call) was not made


def test_consistent_without_source_is_refused_at_start(tmp_path):
    rows = [json.loads(x) for x in (EXAMPLE / "tasks.jsonl").read_text().splitlines()][:3]
    del rows[1]["check"]["source"]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"env": {"suite": "mcp", "reward": "consistent", "options": {
        "server": ["python", str(EXAMPLE / "server.py"), "--db", "{episode_dir}/i.sqlite"],
        "tasks": "tasks.jsonl"}}}))                       # relative to the config's folder
    cfg = load_config(tmp_path / "c.yaml", ["eval.num_tasks=0"])
    assert cfg.env.options["config_dir"] == str(tmp_path.resolve())
    from fastrehearse.train.tasks import build_tasks
    with pytest.raises(ConfigError, match=r"env.reward' = 'consistent': 1 train task\(s\) have no check.source "
                                          rf"\(first: '{rows[1]['id']}'\)") as e:
        build_tasks(cfg)
    assert "\n" not in str(e.value)


def test_fidelity_is_off_for_mcp_unless_asked_or_side_effect_free():
    base = ["env.suite=mcp"]
    cfg = load_config(None, base)
    assert (cfg.rollout.engine.measure_fidelity, cfg.eval.fidelity) == (False, False)
    cfg = load_config(None, base + ["eval.fidelity=true"])
    assert (cfg.rollout.engine.measure_fidelity, cfg.eval.fidelity) == (False, True)
    cfg = load_config(None, base + ["env.options.side_effect_free=true"])
    assert (cfg.rollout.engine.measure_fidelity, cfg.eval.fidelity) == (True, True)
    cfg = load_config(None, [])
    assert (cfg.rollout.engine.measure_fidelity, cfg.eval.fidelity) == (True, True)   # builtin: unchanged


def _train(tmp_path, *sets):
    cmd = [sys.executable, "-m", "fastrehearse.cli", "train", "--config", str(ROOT / "configs" / "mcp_example.yaml"),
           "--set", f"run_dir={tmp_path / 'run'}", "--set", "model.spec=tiny-llama",
           "--set", "model.options={hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2}",
           "--set", "rollout.group_size=2", "--set", "rollout.tasks_per_step=1", "--set", "rollout.max_new_tokens=12",
           "--set", "rollout.max_turns=2", "--set", "sft.tasks_per_step=2", "--set", "steps=1",
           "--set", "checkpoint.export=false", "--set", "log.progress=false", "--set", "eval.num_tasks=2"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x]


def test_train_rehearse_mode_sends_the_server_no_call(tmp_path):
    log = tmp_path / "calls.jsonl"
    rows = _train(tmp_path, "rollout.mode=rehearse", "sft.steps=0", "eval.before=false", "eval.after=false",
                  f"env.options.server=[python, ../examples/mcp_inventory/server.py, --db, "
                  f"'{{episode_dir}}/i.sqlite', --log, {log}]")
    assert [r["stage"] for r in rows if r.get("stage") in ("sft", "rl")] == ["rl"]
    assert log_lines(log) == []


def test_train_hybrid_with_sft_and_real_eval_fidelity(tmp_path):
    log = tmp_path / "calls.jsonl"
    rows = _train(tmp_path, "sft.steps=1", "eval.before=false",
                  f"env.options.server=[python, ../examples/mcp_inventory/server.py, --db, "
                  f"'{{episode_dir}}/i.sqlite', --log, {log}]")
    assert [r["stage"] for r in rows if r.get("stage") in ("sft", "rl")] == ["sft", "rl"]
    tools = [x["tool"] for x in log_lines(log)]
    assert "reset" in tools and len(tools) > 2     # gold calls (SFT) and the real eval reached the server
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # evaluated on the real server; fidelity measured (NaN here: the random model writes no call)
    assert summary["suite"] == "mcp" and summary["n_eval"] == 2 and summary["success_after"] is not None
    assert "fidelity_after" in summary


def _eval_config(tmp_path, log):
    cfg = yaml.safe_load((ROOT / "configs" / "mcp_example.yaml").read_text())
    cfg["env"]["options"].update(server=["python", str(EXAMPLE / "server.py"), "--db", "{episode_dir}/i.sqlite",
                                         "--log", str(log)], tasks="tasks.jsonl")
    (tmp_path / "tasks.jsonl").write_text((EXAMPLE / "tasks.jsonl").read_text())
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "c.yaml"


def test_eval_config_gold_replays_against_the_real_server(tmp_path):
    from fastrehearse.eval import cli
    log = tmp_path / "calls.jsonl"
    conf = _eval_config(tmp_path, log)
    out = tmp_path / "gold"
    assert cli.main(["--config", str(conf), "--policy", "gold", "--limit", "4", "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["suite"] == "mcp" and res["n"] == 4 and res["overall"] == 1.0 and list(res["categories"]) == ["test"]
    tools = [x["tool"] for x in log_lines(log)]
    assert tools.count("reset") >= 4 and len(tools) > 8    # gold trajectories + their replay, for real
    # flags override the config; --suite and --config exclude each other
    args = cli.build_parser().parse_args(["--config", str(conf), "--policy", "gold", "--out", "x", "--max-turns", "2"])
    cli.load_train_config(args)
    assert (args.max_turns, args.max_new_tokens, args.max_episode_tokens) == (2, 96, 1536)
    assert args.measure_fidelity is True                     # the example config's eval.fidelity
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["--config", str(conf), "--suite", "builtin", "--policy", "gold", "--out", "x"])
    assert e.value.code == 2


def test_eval_config_measure_fidelity_with_a_model(tmp_path):
    from fastrehearse.eval import cli
    conf = _eval_config(tmp_path, tmp_path / "calls.jsonl")
    out = tmp_path / "tiny"
    assert cli.main(["--config", str(conf), "--policy", "tiny-llama", "--limit", "2", "--max-new-tokens", "8",
                     "--max-turns", "1", "--measure-fidelity", "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["fidelity_measured"] is True and res["n"] == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"env": {"suite": "mcp", "options": {"server": ["python", "nothing.py"]}}}))
    assert cli.main(["--config", str(bad), "--policy", "gold", "--out", str(tmp_path / "b"), "--quiet"]) == 2


NOTES = '''
import json, os, sys
from mcp.server import MCPServer
app = MCPServer("notes")
LOG = sys.argv[1]

def log(tool, **a):
    with open(LOG, "a") as f:
        f.write(json.dumps({"tool": tool, "arguments": a, "pid": os.getpid()}) + "\\n")

@app.tool()
def add_note(text: str, store: str) -> dict:
    """Add a note."""
    log("add_note", text=text, store=store)
    with open(os.path.join(store, "notes.txt"), "a") as f:
        f.write(text + "\\n")
    return {"count": len(open(os.path.join(store, "notes.txt")).read().splitlines())}

@app.tool()
def count_notes(store: str) -> dict:
    """Count the notes."""
    log("count_notes", store=store)
    p = os.path.join(store, "notes.txt")
    return {"count": len(open(p).read().splitlines()) if os.path.exists(p) else 0}

@app.tool()
def echo(text: str) -> dict:
    """Echo."""
    log("echo", text=text)
    return {"text": text}

app.run()
'''


def test_shared_server_isolations_argument_and_stateless(tmp_path):
    (tmp_path / "notes.py").write_text(NOTES)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "n1", "prompt": "Add a note.", "check": {
        "type": "number", "value": 1, "source": {"tool": "add_note", "field": "count"}},
        "gold_calls": [{"name": "add_note", "arguments": {"text": "hi"}}]}) + "\n")
    log = tmp_path / "calls.jsonl"
    s = get_suite("mcp", server=["python", "notes.py", str(log)], isolation="argument:store", config_dir=str(tmp_path))
    assert s.schemas["add_note"]["function"]["parameters"]["properties"] == {"text": {"type": "string"}}
    task = s.tasks("train")[0]
    assert replay_gold(s, task).score == 1.0
    a, b = s.make_env(), s.make_env()
    a.reset(task)
    b.reset(task)
    assert a.execute(ToolCall("add_note", {"text": "x"})).content == '{"count":1}'
    assert a.execute(ToolCall("add_note", {"text": "y"})).content == '{"count":2}'
    assert b.execute(ToolCall("count_notes", {})).content == '{"count":0}'      # b's own folder
    assert b.execute(ToolCall("echo", {"text": "e"})).content == '{"text":"e"}'  # no store parameter: none added
    assert not b.execute(ToolCall("count_notes", {"store": "/tmp"})).ok          # the agent cannot pick a folder
    a.close()
    b.close()
    calls = log_lines(log)
    assert len({c["pid"] for c in calls}) == 1                                  # one server for all episodes
    assert len({c["arguments"].get("store") for c in calls if c["tool"] != "echo"}) == 4   # gold, replay, a, b
    s.close()
    with pytest.raises(ValueError, match="isolation=argument:folder: no tool of the server has a parameter 'folder'"):
        get_suite("mcp", server=["python", "notes.py", str(log)], isolation="argument:folder", config_dir=str(tmp_path))
    (tmp_path / "echo.jsonl").write_text(json.dumps({"id": "e1", "prompt": "Echo z.", "check": {
        "type": "exact", "value": "z"}}) + "\n")
    with pytest.raises(ValueError, match=r"task 'n1' names tool\(s\) \['add_note'\] the server does not expose"):
        get_suite("mcp", server=["python", "notes.py", str(log)], isolation="stateless", config_dir=str(tmp_path),
                  tools=["echo"])
    st = get_suite("mcp", server=["python", "notes.py", str(log)], isolation="stateless", config_dir=str(tmp_path),
                   tools=["echo"], tasks="echo.jsonl")
    task = st.tasks("train")[0]
    assert list(st.schemas) == ["echo"]
    envs = [st.make_env() for _ in range(3)]
    for e in envs:
        e.reset(task)
        assert e.execute(ToolCall("echo", {"text": "z"})).ok
        e.close()
    assert len({c["pid"] for c in log_lines(log) if c["tool"] == "echo" and c["arguments"]["text"] == "z"}) == 1
    st.close()


def test_url_streamable_http_server(tmp_path):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "calls.jsonl"
    p = subprocess.Popen([sys.executable, str(EXAMPLE / "server.py"), "--db", str(tmp_path / "i.sqlite"), "--log",
                          str(log), "--http", str(port)], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/mcp"
        with pytest.raises(ValueError, match="with url .* say isolation: stateless or argument:NAME"):
            get_suite("mcp", url=url, tasks=str(EXAMPLE / "tasks.jsonl"))
        s = get_suite("mcp", url=url, tasks=str(EXAMPLE / "tasks.jsonl"), isolation="stateless")
        assert "get_item" in s.schemas and s.response_spec("get_item")["keys"][0] == "sku"
        env = s.make_env()
        env.reset(s.tasks("test", limit=1)[0])
        r = env.execute(ToolCall("get_item", {"sku": "SK302"}))
        assert r.ok and json.loads(r.content)["name"] == "tea kettle"
        env.close()
        s.close()
        assert [(x["tool"], x["pid"]) for x in log_lines(log)] == [("get_item", p.pid)]
        assert p.poll() is None            # a server someone else runs is left running
    finally:
        p.terminate()
        p.wait(timeout=30)
