"""BFCL v4 single-turn AST categories as a Suite, so the eval harness runs them like any benchmark.

One task = one BFCL entry; the episode is one assistant turn; nothing is executed (the categories
are graded on the calls themselves): `score` hands the turn to BFCL's `ast_checker` through
fastrehearse.eval.bfcl_single. The model's raw text is graded when the policy kept it
("raw_text"), so a malformed call block fails an AST entry and passes an irrelevance entry exactly
as BFCL's own decoder would decide.
"""
from __future__ import annotations

from fastrehearse.envs.base import ResetResult, Suite, Task, ToolCall, ToolEnv, ToolResult, Trajectory
from fastrehearse.eval import bfcl_single


class BfclSingleTurnEnv(ToolEnv):
    grades_calls_only = True     # the harness ends the episode after one turn without executing

    def __init__(self) -> None:
        self.entry: dict | None = None

    def reset(self, task: Task) -> ResetResult:
        self.entry = task.payload["entry"]
        return ResetResult(tools=bfcl_single.tools_for(self.entry),
                           messages=bfcl_single.prompt_messages(self.entry))

    def execute(self, call: ToolCall) -> ToolResult:
        return ToolResult("Error: single-turn BFCL categories grade calls without executing them",
                          ok=False, error_kind="not_executable")

    def score(self, task: Task, trajectory: Trajectory) -> float:
        turns = [m for m in trajectory.messages if m.get("role") == "assistant"]
        if not turns:
            return 0.0 if bfcl_single.category_of(task.payload["entry"]) in bfcl_single.AST_CATEGORIES else 1.0
        turn = turns[0]
        output = turn["raw_text"] if isinstance(turn.get("raw_text"), str) else turn
        return 1.0 if bfcl_single.score_bfcl_single(task.payload["entry"], output) else 0.0


class BfclSingleTurnSuite(Suite):
    name = "bfcl_single"

    def tasks(self, split: str, limit: int | None = None) -> list[Task]:
        out = []
        for e in bfcl_single.load_category(split, limit):
            out.append(Task(id=e["id"], split=split, payload={"entry": e},
                            gold=[bfcl_single.gold_message(e)]))
        return out

    def make_env(self) -> BfclSingleTurnEnv:
        return BfclSingleTurnEnv()
