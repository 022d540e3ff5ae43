"""BFCL v4 single-turn AST categories as a Suite, so the eval harness runs them like any benchmark.

One task = one BFCL entry; the episode is one assistant turn of the rollout engine; nothing is
executed (the categories are graded on the calls themselves): `score` hands the turn to BFCL's
`ast_checker` through fastrehearse.eval.bfcl_single. The model's raw text is graded (the engine
keeps it as "raw_text"), so a malformed call block fails an AST entry and passes an irrelevance
entry exactly as BFCL's own decoder would decide. A turn cut by the token limit leaves no message:
AST entries then score 0, irrelevance entries 1 (no call was made).
"""
from __future__ import annotations

from fastrehearse.envs.base import ResetResult, Suite, Task, ToolCall, ToolEnv, ToolResult, Trajectory
from fastrehearse.eval import bfcl_single


class BfclSingleTurnEnv(ToolEnv):
    """Protocol (fastrehearse.envs.base): a single-turn task graded on the calls themselves
    (`grades_calls_only`: the engine ends the episode after one agent turn and executes nothing;
    `score` reads that turn's "raw_text"); one user turn, tools fixed at reset, no stop tool."""

    grades_calls_only = True

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
