"""A user's own suite by import path (`env.suite: package.module:Class`): the example of docs/envs.md
is extracted and trained with the real `fastrehearse train` (tiny random Llama, 1 SFT + 1 RL step),
without touching the package; bad paths and non-Suite classes are refused in one line."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastrehearse.envs import get_suite, suite_class
from fastrehearse.train.config import ConfigError, check_env, load_config

ROOT = Path(__file__).resolve().parents[1]


def docs_example() -> str:
    text = (ROOT / "docs" / "envs.md").read_text()
    section = text.split("## Your own suite, by import path", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def write_example(d: Path) -> None:
    (d / "fruit.py").write_text(docs_example())
    prices = {"apple": 0.5, "pear": 0.75, "plum": 0.4}
    rows = []
    for i, (item, q) in enumerate([(f, q) for q in (2, 3, 5) for f in prices]):
        total = round(prices[item] * q, 2)
        gold = [{"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_price", "arguments": {"item": item}}}]},
                {"role": "tool", "content": json.dumps({"item": item, "price": prices[item]})},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "total",
                                                      "arguments": {"price": prices[item], "quantity": q}}}]},
                {"role": "tool", "content": json.dumps({"total": total})},
                {"role": "assistant", "content": f"{q} {item}s cost {total} USD."}]
        rows.append({"id": f"t{i}", "split": "train" if i < 6 else "test",
                     "prompt": f"What do {q} {item}s cost?", "answer": str(total), "gold": gold})
    (d / "fruit_tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_docs_example_is_a_working_suite(tmp_path, monkeypatch):
    write_example(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    suite = get_suite("fruit:FruitSuite", tasks="fruit_tasks.jsonl")
    from fastrehearse.envs import replay_gold
    tasks = suite.tasks("train")
    assert len(tasks) == 6 and len(suite.tasks("test")) == 3
    for t in tasks:
        r = replay_gold(suite, t)
        assert r.score == 1.0 and r.mismatches == []
    env = suite.make_env()
    env.reset(tasks[0])
    from fastrehearse.envs import ToolCall
    bad = env.execute(ToolCall("get_price", {"item": "kiwi"}))
    assert not bad.ok and "kiwi" in bad.content


def test_import_path_errors_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "notasuite.py").write_text("class Thing:\n    pass\nvalue = 3\n"
                                           "from fastrehearse.envs import Suite\nclass Half(Suite):\n    name = 'h'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {"no_such_module_xyz:Suite": "cannot import module 'no_such_module_xyz'",
             "notasuite:Missing": "has no attribute 'Missing'",
             "notasuite:Thing": "not a subclass of fastrehearse.envs.Suite",
             "notasuite:value": "not a subclass of fastrehearse.envs.Suite",
             "notasuite:Half": "is abstract",
             "not a path:X": "an import path is 'package.module:Class'"}
    for path, want in cases.items():
        with pytest.raises(ValueError, match=re.escape(want)) as e:
            suite_class(path)
        assert "\n" not in str(e.value)
        cfg = load_config(None, [f"env.suite={path}"])
        with pytest.raises(ConfigError, match="config key 'env.suite'") as e:
            check_env(cfg)
        assert "\n" not in str(e.value) and want in str(e.value)


def test_options_are_checked_against_the_user_constructor(tmp_path, monkeypatch):
    write_example(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["env.suite=fruit:FruitSuite", "env.options={task: x.jsonl}"])
    with pytest.raises(ConfigError, match=r"unknown config key 'env.options.task' \(did you mean 'tasks'\?\)"):
        check_env(cfg)
    cfg = load_config(None, ["env.suite=fruit:FruitSuite", "env.options={tasks: 3}"])
    with pytest.raises(ConfigError, match="'env.options.tasks' must be str"):
        check_env(cfg)


def test_fastrehearse_train_runs_the_docs_example(tmp_path):
    """The real command, a config naming the user's class, the module beside it (not installed)."""
    write_example(tmp_path)
    cfg = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    cfg.update(run_dir=str(tmp_path / "run"), steps=1)
    cfg["env"] = {"suite": "fruit:FruitSuite", "options": {"tasks": "fruit_tasks.jsonl"}}
    cfg["sft"].update(steps=1)
    cfg["rollout"].update(max_turns=3, max_episode_tokens=768)
    cfg["max_tokens"] = 1536
    cfg["checkpoint"] = {"every": 0, "export": False}
    (tmp_path / "fruit.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "fastrehearse.cli", "train", "--config", "fruit.yaml"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["stage"] for r in rows if r.get("stage") in ("sft", "rl")] == ["sft", "rl"]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["env"]["suite"] == "fruit:FruitSuite"
