"""Low-noise companions to success rates: teacher-forced log-probs and teacher-forced rehearsal.

A success rate on 64 items moves in steps of 1.6 points and its seed-to-seed spread is large
(docs/learning.md). These two measure the same skills on every item, without sampling:

  answer / response log-prob   the gold trajectory (system, user, gold calls, the REAL tool
                               responses, the gold final answer) is rendered with the chat template
                               and run through the model once; we sum log p(token | prefix) over the
                               final answer's tokens ("can the policy state what the real tool said")
                               and over the tool responses' tokens ("how likely is the real response
                               to the world model"), per item and per token. The answer's log-prob
                               also rewards the gold *phrasing*, which RL moves away from while
                               staying right, so `value_logprob` sums only the tokens that spell the
                               answer's value (the balance, the count, the status) in the gold answer.
  rehearsal fidelity split     the gold first call is forced (GoldPolicy), the model writes the tool
                               response greedily (rehearse mode, one turn), and the response is
                               compared with the real one for that call in three parts:
                                 schema  Jaccard of the key paths (list indices as [*])
                                 echo    the fields that echo an argument (Suite.response_spec) carry it
                                 hidden  the real response's other leaves (values the world model
                                         must know: a balance, a stock count) found with equal value
                               plus the engine's field F1. Schema and echo can be learned from the
                               format alone; hidden values only from the world. On the builtin
                               suite also split by what the episode reveals (envs/builtin/rules.py):
                                 rule_predictable  top-level fields the tool's documented rules and
                                                   the earlier responses give (echoes included)
                                 rule_hidden       the other top-level fields (seeded values, new ids)

    python -m fastrehearse.eval.teacher_forced --model runs/x/export --level easy@-accounts \
        --n 256 --out runs/x/teacher_forced.json
Writes per-item rows and means; the bench (benchmarks/bench_learning.py) runs it per checkpoint.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch

from fastrehearse.algo.rewards import echo_equal
from fastrehearse.envs import get_suite
from fastrehearse.envs.base import Suite, Task
from fastrehearse.envs.builtin.expectations import fidelity_by_label
from fastrehearse.envs.builtin.tasks import NUMBER
from fastrehearse.envs.replay import exchanges_of, tool_calls_of
from fastrehearse.kernels.roles import Role
from fastrehearse.rollout import ChatTemplate, GoldPolicy, RolloutConfig, RolloutEngine
from fastrehearse.rollout.engine.fidelity import json_fields
from fastrehearse.rollout.text.gold import gold_replies, render_gold


# ---- teacher-forced log-probs -----------------------------------------------------------------
def value_span(tokenizer, ids: list[int], span: tuple[int, int], spec: dict | None) -> list[tuple[int, int]]:
    """The tokens of the answer span that spell the answer's value (builtin answer spec: the number
    within its tolerance, the id / time, the status or location), as [(start, end)]; [] when the
    spec is unknown or the value is not written in the gold answer."""
    if not spec or "kind" not in spec:
        return []
    s, e = span
    text = tokenizer.decode(ids[s:e])
    kind, value = spec["kind"], spec["value"]
    if kind == "number":
        tol = max(spec.get("abs_tol", 0.0), spec.get("rel_tol", 0.0) * abs(value)) + 1e-9
        m = next((m for m in NUMBER.finditer(text) if abs(float(m.group().replace(",", "")) - value) <= tol), None)
    elif kind == "token":
        m = re.search(rf"(?<![\w:]){re.escape(value)}(?![\w:])", text, re.IGNORECASE)
    else:
        m = re.search(rf"\b{re.escape(value)}\b", text, re.IGNORECASE)
    if m is None:
        return []
    ends = [len(tokenizer.decode(ids[s:t + 1])) for t in range(s, e)]     # char end of each token
    starts = [0] + ends[:-1]
    toks = [s + i for i, (a, b) in enumerate(zip(starts, ends)) if a < m.end() and b > m.start()]
    return [(toks[0], toks[-1] + 1)] if toks else []


def _render_gold(tmpl, suite: Suite, task: Task) -> tuple[list[int], list, list, tuple, list]:
    """Token ids, final-answer spans, tool-response spans ((start, end) token ranges), a key of the
    prompt's tools, and the answer's value tokens (`value_span`)."""
    if not task.gold or task.gold[-1].get("role") != "assistant" or task.gold[-1].get("tool_calls"):
        raise ValueError(f"task {task.id!r}: its gold trajectory does not end with a final answer")
    g = render_gold(tmpl, suite, task)
    r = g.rendered
    answer = [(s, e) for s, e, role, mi in r.spans if mi == len(g.messages) - 1 and role == int(Role.ACT)]
    responses = [(s, e) for s, e, role, mi in r.spans if role == int(Role.OBSERVED)]
    if not answer:
        raise ValueError(f"task {task.id!r}: the rendered gold has no final-answer tokens")
    value = value_span(tmpl.tokenizer, r.input_ids, answer[-1], task.payload.get("answer")
                       if isinstance(task.payload, dict) else None)
    return r.input_ids, answer, responses, tuple(json.dumps(t, sort_keys=True) for t in g.tools), value


def gold_logprobs(model, tokenizer, suite: Suite, tasks: Sequence[Task], *, template=None,
                  batch_size: int = 8) -> list[dict]:
    """One row per task: the summed log-prob (natural log) of the gold final answer's tokens and of
    the real tool responses' tokens given everything before them; no sampling.

    Tasks with the same tools share their rendered prefix (system prompt + tool schemas, ~2/3 of an
    EASY item): it is run once per group and its KV cache reused for the group's suffixes, batched
    and right-padded (causal attention: padding after a row's last token never reaches it)."""
    tmpl = template or ChatTemplate(tokenizer)
    device = next(model.parameters()).device
    model.eval()
    items = [_render_gold(tmpl, suite, t) for t in tasks]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        groups[it[3]].append(i)
    rows: list[dict | None] = [None] * len(items)
    for idx in groups.values():
        seqs = [items[i][0] for i in idx]
        first = min(s for i in idx for s, _ in items[i][1] + items[i][2])
        # logits at position first-1 predict the first scored token: the prefix stops before it
        n = min(len(_common_prefix(seqs)), max(first - 1, 0))
        cache = None
        with torch.no_grad():
            if n > 0:
                cache = model(input_ids=torch.tensor([seqs[0][:n]], device=device), use_cache=True).past_key_values
            for b in range(0, len(idx), batch_size):
                part = idx[b:b + batch_size]
                tails = [items[i][0][n:] for i in part]
                width = max(map(len, tails))
                ids = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tails], device=device)
                kw = {}
                if cache is not None:
                    c = copy.deepcopy(cache)
                    c.batch_repeat_interleave(len(part))
                    kw = {"past_key_values": c, "use_cache": True}
                logits = model(input_ids=ids, **kw).logits.float()
                for row, i in enumerate(part):
                    seq, answer, responses, _, value = items[i]
                    a, na = _span_logprob(logits[row], seq, answer, n)
                    o, no = _span_logprob(logits[row], seq, responses, n)
                    v, nv = _span_logprob(logits[row], seq, value, n)
                    rows[i] = {"id": tasks[i].id, "answer_logprob": a, "answer_tokens": na,
                               "value_logprob": v if nv else None, "value_tokens": nv,
                               "response_logprob": o, "response_tokens": no}
    return rows


def _span_logprob(logits: torch.Tensor, seq: list[int], spans, offset: int) -> tuple[float, int]:
    """Summed log p(token t) over the tokens of `spans`; logits[j] is at position offset + j and
    predicts the token after it."""
    toks = [t for s, e in spans for t in range(max(s, 1), e)]
    if not toks:
        return 0.0, 0
    lp = torch.log_softmax(logits[[t - 1 - offset for t in toks]], dim=-1)
    target = torch.tensor([seq[t] for t in toks], device=logits.device)
    return float(lp.gather(1, target[:, None]).sum()), len(toks)


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    out = seqs[0]
    for s in seqs[1:]:
        k = 0
        while k < min(len(out), len(s)) and out[k] == s[k]:
            k += 1
        out = out[:k]
    return out


# ---- teacher-forced rehearsal -------------------------------------------------------------------
def _paths(value: Any, prefix: str = "$") -> set[str]:
    if isinstance(value, dict) and value:
        return {p for k, v in value.items() for p in _paths(v, f"{prefix}.{k}")}
    if isinstance(value, list) and value:
        return {p for v in value for p in _paths(v, f"{prefix}[*]")}
    return {prefix}


def _load(text: str | None) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None


def fidelity_split(arguments: Any, rehearsed: str | None, real: str, spec: dict | None) -> dict:
    """schema / echo / hidden agreement of one rehearsed response with the real one (module
    docstring); a part that does not apply (no echo field, no hidden leaf) is None."""
    a, b = _load(rehearsed), _load(real)
    if not isinstance(b, (dict, list)):
        same = float(isinstance(rehearsed, str) and rehearsed.strip() == real.strip())
        return {"schema": same, "echo": None, "hidden": same}
    args = arguments if isinstance(arguments, dict) else {}
    echo_keys = {o: g for o, g in ((spec or {}).get("echo") or {}).items()
                 if g in args and isinstance(b, dict) and o in b}
    pa, pb = (_paths(a) if isinstance(a, (dict, list)) else set()), _paths(b)
    out = {"schema": len(pa & pb) / len(pa | pb) if pa | pb else 1.0, "echo": None, "hidden": None}
    if echo_keys:
        out["echo"] = sum(isinstance(a, dict) and echo_equal(args[g], a.get(o)) for o, g in echo_keys.items()) \
            / len(echo_keys)
    fb = json_fields(b)
    hidden = {k: n for k, n in fb.items() if not any(k[0] == f"$.{o}" for o in echo_keys)}
    if hidden:
        fa = json_fields(a) if isinstance(a, (dict, list)) else {}
        out["hidden"] = sum(min(n, fa.get(k, 0)) for k, n in hidden.items()) / sum(hidden.values())
    return out


def rehearsal_fidelity(model, tokenizer, suite: Suite, tasks: Sequence[Task], *, max_new_tokens: int = 96,
                       max_episode_tokens: int = 4096, batch_size: int = 32) -> list[dict]:
    """One row per task: the model rehearses the response to the task's first gold call (forced),
    greedily; compared with the real response of that call on a fresh world."""
    eng = RolloutEngine(model, tokenizer, RolloutConfig(
        mode="rehearse", measure_fidelity=True, temperature=0.0, max_turns=1, max_new_tokens=max_new_tokens,
        max_episode_tokens=max_episode_tokens, max_batch_size=batch_size))
    res = eng.rollout(list(tasks), suite, group_size=1, seed=0, policy=GoldPolicy())
    rows = []
    for task, ep, traj in zip(tasks, res.episodes, res.trajectories):
        calls = tool_calls_of(gold_replies(task)[:1])
        env = suite.make_env()
        try:
            env.reset(task)
            real = [env.execute(c).content for c in calls]
        finally:
            env.close()
        made = [ex for ex in exchanges_of(traj.messages) if ex.rehearsed]
        row = {"id": task.id, "calls": len(calls), "rehearsed": len(made), "error": ep.metadata.get("error"),
               "text": [(ex.content or "")[:300] for ex in made], "real": [r[:300] for r in real]}
        parts = []
        for c, r, ex in zip(calls, real, made + [None] * (len(calls) - len(made))):
            parts.append(fidelity_split(c.arguments, ex.content if ex else None, r, suite.response_spec(c.name)))
            if getattr(suite, "name", None) == "builtin":   # the first call: nothing revealed before it
                lab = fidelity_by_label([], c.name, c.arguments, ex.content if ex else None, r)
                parts[-1].update(rule_predictable=lab["predictable"], rule_hidden=lab["hidden"])
        for k in ("schema", "echo", "hidden", "rule_predictable", "rule_hidden"):
            v = [p[k] for p in parts if p.get(k) is not None]
            row[k] = sum(v) / len(v) if v else None
        f1 = [s["field_f1"] for s in ep.metadata.get("fidelity", [])]
        row["field_f1"] = sum(f1) / len(f1) if f1 else 0.0
        rows.append(row)
    return rows


# ---- summary and CLI ---------------------------------------------------------------------------
def summarize(lp_rows: list[dict], fid_rows: list[dict]) -> dict:
    def mean(xs):
        xs = [x for x in xs if x is not None and math.isfinite(x)]
        return sum(xs) / len(xs) if xs else None
    out = {"n_logprob": len(lp_rows), "n_rehearsal": len(fid_rows)}
    if lp_rows:
        out["answer_logprob"] = mean([r["answer_logprob"] for r in lp_rows])          # nats per answer
        out["answer_logprob_per_token"] = sum(r["answer_logprob"] for r in lp_rows) / max(
            1, sum(r["answer_tokens"] for r in lp_rows))
        # the tokens that spell the value only: the answer's phrasing does not enter
        out["value_logprob"] = mean([r.get("value_logprob") for r in lp_rows])
        out["value_found"] = sum(r.get("value_logprob") is not None for r in lp_rows) / len(lp_rows)
        out["response_logprob_per_token"] = sum(r["response_logprob"] for r in lp_rows) / max(
            1, sum(r["response_tokens"] for r in lp_rows))
    for k in ("schema", "echo", "hidden", "rule_predictable", "rule_hidden", "field_f1"):
        out[f"rehearsal_{k}"] = mean([r.get(k) for r in fid_rows])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model spec (an export dir, smollm2, tiny-llama)")
    p.add_argument("--suite", default="builtin")
    p.add_argument("--level", default="easy", help="builtin level (may hold out a family: easy@accounts)")
    p.add_argument("--tools", default="task")
    p.add_argument("--split", default="test")
    p.add_argument("--n", type=int, default=256, help="items for the log-prob metric")
    p.add_argument("--n-rehearsal", type=int, default=128, help="items for the rehearsal split (0: skip)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.n < 1 or a.n_rehearsal < 0:
        p.error(f"--n must be >= 1 and --n-rehearsal >= 0, got {a.n} and {a.n_rehearsal}")
    if a.suite != "builtin":
        p.error(f"--suite {a.suite!r}: only the builtin suite has gold final answers to score")
    from fastrehearse.model.loader import ModelSpecError, load_model   # transformers: after the arguments parse
    try:
        suite = get_suite("builtin", level=a.level, tools=a.tools, easy_answer=True)
        tasks = suite.tasks(a.split, limit=max(a.n, a.n_rehearsal))
    except ValueError as e:
        p.error(str(e))
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        model, tok = load_model(a.model)
    except ModelSpecError as e:
        p.error(str(e))
    t0 = time.perf_counter()
    lp = gold_logprobs(model, tok, suite, tasks[:a.n])
    t1 = time.perf_counter()
    fid = rehearsal_fidelity(model, tok, suite, tasks[:a.n_rehearsal]) if a.n_rehearsal else []
    t2 = time.perf_counter()
    res = {"model": a.model, "level": a.level, "tools": a.tools, "split": a.split,
           "summary": summarize(lp, fid), "seconds": {"logprob": t1 - t0, "rehearsal": t2 - t1},
           "logprob_items": lp, "rehearsal_items": fid}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
