"""rehearsal="separate": the paper-code style baseline that benchmarks/bench_rollout.py compares
inline rehearsal against. Per rehearsed call a fresh simulator prompt (a system prompt, the tools,
the conversation so far and the call) is decoded as its own row, on the same backend, and its
tokens are copied into the episode as REHEARSE."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

from fastrehearse.rollout.config import Prompt
from fastrehearse.rollout.decode import decode
from fastrehearse.rollout.row import Row, RowSettings
from fastrehearse.rollout.segments import Sampling, SegmentBackend

SIMULATOR_SYSTEM = ("You simulate the tool environment of an AI agent. Given the conversation so far and "
                    "the agent's latest tool call, reply with exactly the response the tool would "
                    "return (usually JSON) and nothing else.")


def simulate(rows: list[Row], settings: RowSettings, backend: SegmentBackend, sampling: Sampling,
             stats: Counter) -> None:
    """Write the response of every row's waiting call (`row.waiting_sim`) with a simulator prompt."""
    tmpl = settings.template
    prompts = []
    for r in rows:
        convo = json.dumps(r.p.messages + r.traj.messages, ensure_ascii=False, default=str)
        msgs = [{"role": "system", "content": SIMULATOR_SYSTEM},
                {"role": "user", "content": f"Tools: {json.dumps(r.tools)}\nConversation: {convo}\n"
                                            f"Tool call: {r.waiting_sim.raw.strip()}"}]
        sim = tmpl.render_prompt(msgs)
        prompts.append(Prompt(sim.input_ids, sim.roles, [], seed=r.rng.randrange(2**31)))
    # The simulator writes one plain assistant turn: no policy, no separate simulation of its own.
    sub = replace(settings, has_policy=False,
                  config=replace(settings.config, rehearsal="inline", max_turns=1, parallel_tool_calls=True))
    sim_rows = [Row(sub, i, p) for i, p in enumerate(prompts)]
    decode(sim_rows, backend, sampling, stats)
    stats["simulator_prompts"] += len(sim_rows)
    for r, s in zip(rows, sim_rows):
        gen_ids = s.ids[len(s.p.input_ids):]
        gen_lp = s.logps[len(s.p.input_ids):]
        text = tmpl.tokenizer.decode(gen_ids)
        for m in tmpl.assistant_end_markers:  # drop the simulator's end-of-turn
            if text.endswith(m):
                n = len(tmpl.encode(m))
                gen_ids, gen_lp, text = gen_ids[:-n], gen_lp[:-n], text[:-len(m)]
                break
        r.on_simulated(gen_ids, gen_lp, text)
