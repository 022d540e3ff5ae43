"""The episode driver and its state: `RolloutEngine` (engine.py) runs rows (row.py: one episode's
state machine) through the decode loop (decode.py); calls.py routes and executes tool calls;
policy.py says who writes the agent's turns; episode.py assembles episodes and metrics; fidelity.py
scores rehearsed against real responses; simulator.py is the hook for a separate response
simulator. The public names are exported by `fastrehearse.rollout`."""
