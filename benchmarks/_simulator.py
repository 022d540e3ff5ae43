"""The separate-simulator baseline that benchmarks/bench_rollout.py compares inline rehearsal
against (the style of the paper's official code). Per rehearsed call a fresh simulator prompt (a
system prompt, the tools, the conversation so far and the call) is decoded as its own row, on the
engine's backend, and its tokens are copied into the episode as REHEARSE. It plugs into the engine's
hook: `RolloutEngine(..., simulator=SeparateSimulator(template))` (fastrehearse.rollout.engine.simulator)."""
from __future__ import annotations

import json

from fastrehearse.rollout import ChatTemplate, Prompt
from fastrehearse.rollout.engine.simulator import GenerateTurns, SimulatedResponse, SimulatorCall

SIMULATOR_SYSTEM = ("You simulate the tool environment of an AI agent. Given the conversation so far and "
                    "the agent's latest tool call, reply with exactly the response the tool would "
                    "return (usually JSON) and nothing else.")


class SeparateSimulator:
    """A simulator prompt per call; `prompts` counts the prompts decoded."""

    def __init__(self, template: ChatTemplate):
        self.tmpl = template
        self.prompts = 0

    def respond(self, calls: list[SimulatorCall], generate: GenerateTurns) -> list[SimulatedResponse]:
        tmpl = self.tmpl
        prompts = []
        for c in calls:
            convo = json.dumps(c.messages, ensure_ascii=False, default=str)
            msgs = [{"role": "system", "content": SIMULATOR_SYSTEM},
                    {"role": "user", "content": f"Tools: {json.dumps(c.tools)}\nConversation: {convo}\n"
                                                f"Tool call: {c.call}"}]
            sim = tmpl.render_prompt(msgs)
            prompts.append(Prompt(sim.input_ids, sim.roles, [], seed=c.seed))
        out = []
        for gen_ids, gen_lp in generate(prompts):
            text = tmpl.tokenizer.decode(gen_ids)
            for m in tmpl.assistant_end_markers:  # drop the simulator's end-of-turn
                if text.endswith(m):
                    n = len(tmpl.encode(m))
                    gen_ids, gen_lp, text = gen_ids[:-n], gen_lp[:-n], text[:-len(m)]
                    break
            out.append(SimulatedResponse(gen_ids, gen_lp, text))
        self.prompts += len(prompts)
        return out
