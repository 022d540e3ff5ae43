"""BuiltinSuite / BuiltinEnv: the embedded default environment (no downloads, pure Python).

Held-out tool family: a level may name a tool family (a DOMAINS key: accounts, shop, calendar,
convert) after "@": "mixed@-calendar" = mixed levels without any calendar tool (the train side: no
calendar tool is ever exposed, called or named), "mixed@calendar" = calendar tasks only (the test
side: tools never seen in training). The family is part of `level` so every caller that passes a
level (the trainer's env.options, `fastrehearse eval --categories test:mixed@calendar`) can select it.
"""
from __future__ import annotations

from typing import Any, Sequence

from fastrehearse.envs.base import ResetResult, Suite, Task, ToolCall, ToolEnv, ToolResult, Trajectory
from fastrehearse.envs.builtin import expectations, scoring
from fastrehearse.envs.builtin.tasks import RULES_LEVEL, TEMPLATES, generate
from fastrehearse.envs.builtin.tools import DOMAINS, RESPONSES, SCHEMAS, dumps, execute
from fastrehearse.envs.builtin.world import make_world
from fastrehearse.envs.replay import exchanges_of
from fastrehearse.envs.scramble import ScrambleEnv

SYSTEM_PROMPT = ("You are a helpful assistant with access to tools. Use the tools to look up what you "
                 "need or to make changes; then reply to the user with a short final answer.")
# "rules" (level 4) is the family whose responses follow documented rules (tasks.py); "all" is
# levels 0-3 without it, so a config or a result that names "all" always means the same task set.
LEVEL_PRESETS = {"easy": (0,), "mixed": (1, 2, 3), "all": (0, 1, 2, 3), "hard": (3,), "rules": (4,)}
TOOL_MODES = ("auto", "task", "domain", "all")
SPLITS = ("train", "test")
_DOMAIN_OF = {t: d for d, ts in DOMAINS.items() for t in ts}


def parse_level_spec(level: int | str | Sequence[int]) -> tuple[tuple[int, ...], frozenset[str] | None]:
    """level [@FAMILY | @-FAMILY] -> (levels, allowed tool families or None for all)."""
    if not (isinstance(level, str) and "@" in level):
        return parse_levels(level), None
    base, _, fam = level.partition("@")
    name = fam[1:] if fam.startswith("-") else fam
    if name not in DOMAINS:
        raise ValueError(f"level={level!r}: after '@' expected a tool family (or '-' and one) from "
                         f"{sorted(DOMAINS)}, got {fam!r}")
    levels = parse_levels(base)
    # The ledger tools exist for the rules family only: "easy@-accounts" keeps meaning (and naming
    # its task ids after) the four families of levels 0-3.
    every = frozenset(DOMAINS) - (frozenset() if RULES_LEVEL in levels else {"ledger"})
    families = every - {name} if fam.startswith("-") else frozenset({name})
    return levels, families


def parse_levels(level: int | str | Sequence[int]) -> tuple[int, ...]:
    if isinstance(level, str):
        if level in LEVEL_PRESETS:
            return LEVEL_PRESETS[level]
        level = [int(x) for x in level.split(",")] if all(
            x.strip().isdigit() for x in level.split(",")) else level
    if isinstance(level, int) and not isinstance(level, bool):
        level = [level]
    if isinstance(level, str) or not all(isinstance(x, int) and x in TEMPLATES for x in level) or not level:
        raise ValueError(f"level={level!r}: expected one of {sorted(LEVEL_PRESETS)}, a level in "
                         f"{sorted(TEMPLATES)}, or a list of levels")
    return tuple(level)


class BuiltinEnv(ToolEnv):
    """One episode's world. `world` is the live database (inspect it after an episode).

    Protocol (fastrehearse.envs.base): one user turn (no next_user_message), tools fixed at reset
    (`tools` None), arguments checked by the driver against the schemas, no stop tool."""

    tools = None                  # fixed at reset
    validates_calls = False       # the engine checks names and schemas (execute checks again)
    control_tools = frozenset()   # no stop tool: a text reply ends the task

    def __init__(self) -> None:
        self.world: dict[str, Any] | None = None
        self.tool_names: list[str] = []     # the task's visible tools (execute refuses others)

    def reset(self, task: Task) -> ResetResult:
        p = task.payload
        self.world = make_world(p["world_seed"])
        self.tool_names = list(p["tools"])
        return ResetResult(tools=[SCHEMAS[t] for t in self.tool_names],
                           messages=[{"role": "system", "content": SYSTEM_PROMPT},
                                     {"role": "user", "content": p["prompt"]}])

    def execute(self, call: ToolCall) -> ToolResult:
        if self.world is None:
            return ToolResult(content=dumps({"error": "environment not reset"}), ok=False,
                              error_kind="env_error")
        return execute(self.world, getattr(call, "name", None), getattr(call, "arguments", None),
                       self.tool_names)

    def score(self, task: Task, trajectory: Trajectory) -> float:
        return scoring.score(task.payload, trajectory)

    def fidelity_by_label(self, messages: list[dict], call: ToolCall, rehearsed: str, real: str) -> dict:
        """Rehearsal fidelity on the predictable and the hidden fields of `real`, given the
        episode's messages before the call (envs/builtin/rules.py)."""
        return expectations.fidelity_by_label(exchanges_of(messages), call.name, call.arguments, rehearsed, real)


class BuiltinSuite(Suite):
    """Seeded, procedurally generated multi-step tool-use tasks.

    level: "easy" (= 0: one spelled-out call; success = that call was made), "mixed" (= 1,2,3,
        default), "all" (= 0-3), "hard" (= 3), "rules" (= 4: responses predictable from the episode
        and the documented rules, envs/builtin/rules.py), an int 0-4, or a list of ints. Tasks rotate over the levels.
        A string level may end in "@FAMILY" (only that tool family's tasks, e.g. "mixed@calendar")
        or "@-FAMILY" (every family but that one, tools included: "mixed@-calendar"): a held-out
        tool family for training on one and testing on the other (docs/learning.md).
    n_train / n_test: how many tasks `tasks(split)` returns when no limit is given (any index is valid;
        tasks are generated on demand and cached).
    tools: which tool schemas the model sees: "auto" (the task's domain tools, e.g. all 3 account
        tools; at level 0 only the named tool), "task" (only the tools the gold solution uses: the
        shortest prompts), "domain" (domain tools at every level), or "all" (every tool).
    easy_answer: level 0 also requires the final answer to state the tool's result.
    seed: shifts the whole task set; splits stay disjoint for every seed.
    scramble: every environment is wrapped in `envs.scramble.ScrambleEnv` (the Cv control: the real
        tools run, responses keep their schema and echoes, every other value is random; seeded by
        the task id). The `consistent` reward then skips the rules check, which random content
        breaks by construction, and grades calls, state and answer inside the scrambled episode.
    """
    name = "builtin"

    def __init__(self, level: int | str | Sequence[int] = "mixed", n_train: int = 2000, n_test: int = 300,
                 tools: str = "auto", easy_answer: bool = False, seed: int = 0, scramble: bool = False) -> None:
        self.levels, self.families = parse_level_spec(level)
        for arg, v in (("n_train", n_train), ("n_test", n_test), ("seed", seed)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{arg}={v!r}: expected an int >= 0")
        if tools not in TOOL_MODES:
            raise ValueError(f"tools={tools!r}: expected one of {TOOL_MODES}")
        self.sizes = {"train": n_train, "test": n_test}
        if not isinstance(scramble, bool):
            raise ValueError(f"scramble={scramble!r}: expected true or false")
        self.tool_mode, self.easy_answer, self.seed, self.scramble = tools, bool(easy_answer), seed, scramble
        self._cache: dict[tuple[str, int], Task] = {}

    def task(self, split: str, i: int) -> Task:
        """The i-th task of a split (deterministic for (seed, level, split, i))."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: the builtin suite has splits {SPLITS}")
        key = (split, i)
        if key not in self._cache:
            level = self.levels[i % len(self.levels)]
            g = generate(split, level, i // len(self.levels), self.seed, self.families)
            gold = g.pop("gold")
            if self.tool_mode == "all":   # every tool of the allowed families
                g["tools"] = [t for t in SCHEMAS if self.families is None or _DOMAIN_OF[t] in self.families]
            elif self.tool_mode == "task":   # only the tools the gold solution uses (short prompts)
                used = {tc["function"]["name"] for m in gold for tc in m.get("tool_calls") or []}
                g["tools"] = [t for t in SCHEMAS if t in used]
            elif self.tool_mode == "domain" or level > 0:
                g["tools"] = sorted({t for name in g["tools"] for t in DOMAINS[_DOMAIN_OF[name]]},
                                    key=list(SCHEMAS).index)
            g["checks"] = ["calls", "state"] + (["answer"] if level > 0 or self.easy_answer else [])
            tag = f"s{self.seed}-" if self.seed else ""
            if self.families is not None:   # a family-filtered task i differs from the unfiltered one
                tag += "+".join(sorted(self.families)) + "-"
            self._cache[key] = Task(id=f"builtin-{tag}{split}-L{level}-{i:05d}", split=split,
                                    payload=g, gold=gold)
        return self._cache[key]

    def tasks(self, split: str, limit: int | None = None) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: the builtin suite has splits {SPLITS}")
        n = self.sizes[split] if limit is None else limit
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"limit={limit!r}: expected an int >= 0 or None")
        return [self.task(split, i) for i in range(n)]

    def make_env(self) -> ToolEnv:
        if self.scramble:
            return ScrambleEnv(BuiltinEnv(), seed=self.seed)
        return BuiltinEnv()

    # Training rewards (envs/builtin/scoring.py): "calls" drops the answer check, "consistent"
    # grades inside the episode's own world (rehearsed or real responses), executing nothing.
    reward_modes = scoring.REWARD_MODES

    def task_reward(self, task: Task, trajectory: Trajectory, mode: str) -> float:
        if mode not in self.reward_modes:
            return super().task_reward(task, trajectory, mode)
        if mode == "consistent" and self.scramble:
            return scoring.score_consistent(task.payload, trajectory, check_rules=False)
        return scoring.score(task.payload, trajectory, mode)

    def response_spec(self, tool: str) -> dict | None:
        return RESPONSES.get(tool)
