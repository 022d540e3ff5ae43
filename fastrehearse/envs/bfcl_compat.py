"""Import shim for the `bfcl-eval` package (BFCL v4), installed with --no-deps.

Two things stop BFCL's checkers from importing in a lean, offline install:
1. `bfcl_eval.constants.eval_config` creates `result/`, `score/` and `.file_locks/` under
   `BFCL_PROJECT_ROOT` at import time (by default next to site-packages, which may be read-only).
   We point it at a writable cache folder before the first `bfcl_eval` import.
2. `bfcl_eval.constants.model_config` imports every vendor handler (anthropic, openai, cohere, ...).
   The AST checker only reads `MODEL_CONFIG_MAPPING[name].underscore_to_dot`, so we register a small
   stand-in module in `sys.modules` that answers that one question for any model name.

Every other module in fastrehearse imports BFCL through `import_bfcl()` / the helpers below, so the
shim is applied exactly once, before anything touches `bfcl_eval`.
"""
from __future__ import annotations

import copy
import functools
import os
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

# The name we pass as `model_name` to BFCL's checkers. It only affects instance-cache keys and
# the (stand-in) model config lookup.
CHECKER_MODEL_NAME = "fastrehearse"

SINGLE_TURN_AST_CATEGORIES = (
    "simple_python", "multiple", "parallel", "parallel_multiple",
    "live_simple", "live_multiple", "irrelevance", "live_irrelevance",
)
MULTI_TURN_CATEGORIES = (
    "multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context",
)

_MODEL_CONFIG = "bfcl_eval.constants.model_config"


def _writable_project_root() -> str:
    """BFCL_PROJECT_ROOT if set, else ~/.cache/fastrehearse/bfcl, else a fresh temp folder."""
    if os.environ.get("BFCL_PROJECT_ROOT"):
        return os.environ["BFCL_PROJECT_ROOT"]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastrehearse" / "bfcl"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        probe = cache / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
        return str(cache)
    except OSError:
        return tempfile.mkdtemp(prefix="fastrehearse_bfcl_")


@dataclass(frozen=True)
class _StandInModelConfig:
    # False: keep '.' in function names (we never rename tools), which is what the AST checker
    # does for models that support dotted names.
    underscore_to_dot: bool = False


class _AnyModelConfig(dict):
    """MODEL_CONFIG_MAPPING stand-in: every model name maps to the same minimal config."""

    def __missing__(self, key):
        return _StandInModelConfig()


@functools.lru_cache(maxsize=None)
def install_shim() -> str:
    """Apply the shim (idempotent). Returns the BFCL project root in use."""
    root = _writable_project_root()
    os.environ["BFCL_PROJECT_ROOT"] = root
    if "bfcl_eval.constants.eval_config" in sys.modules:
        # Imported before us: its folders already exist wherever it pointed; nothing to redo.
        pass
    if _MODEL_CONFIG in sys.modules:
        # A full install imported the real module already: make our checker name resolvable.
        mapping = sys.modules[_MODEL_CONFIG].MODEL_CONFIG_MAPPING
        mapping.setdefault(CHECKER_MODEL_NAME, _StandInModelConfig())
    else:
        stand_in = types.ModuleType(_MODEL_CONFIG)
        stand_in.__doc__ = "fastrehearse stand-in: avoids importing every vendor SDK."
        stand_in.MODEL_CONFIG_MAPPING = _AnyModelConfig()
        stand_in.ModelConfig = _StandInModelConfig
        sys.modules[_MODEL_CONFIG] = stand_in
    return root


def import_bfcl() -> types.SimpleNamespace:
    """The BFCL pieces fastrehearse uses, imported behind the shim."""
    install_shim()
    try:
        from bfcl_eval import utils as bfcl_utils
        from bfcl_eval.constants import executable_backend_config as backend_config
        from bfcl_eval.constants.enums import Language
        from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker as mt_checker
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as mt_utils
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            f"bfcl-eval is not importable ({e}). Install it as requirements/nodeps.txt says: "
            "pip install --no-deps bfcl-eval==2026.3.23 plus requirements/runtime-deps.txt"
        ) from e
    return types.SimpleNamespace(
        utils=bfcl_utils, backend_config=backend_config, Language=Language, ast_checker=ast_checker,
        multi_turn_checker=mt_checker.multi_turn_checker, multi_turn_utils=mt_utils,
    )


@functools.lru_cache(maxsize=None)
def _load_entries_cached(category: str) -> tuple[dict, ...]:
    bfcl = import_bfcl()
    # BFCL's own loader: adds the language hint to function docs, fills multi-turn function docs
    # from `multi_turn_func_doc/` and moves held-out docs into `missed_function` (miss_func).
    return tuple(bfcl.utils.load_dataset_entry(category))


@functools.lru_cache(maxsize=None)
def _load_answers_cached(category: str) -> dict[str, dict]:
    bfcl = import_bfcl()
    return {a["id"]: a for a in bfcl.utils.load_ground_truth_entry(category)}


def _check_category(category: str) -> None:
    known = SINGLE_TURN_AST_CATEGORIES + MULTI_TURN_CATEGORIES + (
        "live_parallel", "live_parallel_multiple", "simple_java", "simple_javascript")
    if category not in known:
        raise ValueError(f"category: unknown BFCL category {category!r}; known: {list(known)}")


def load_entries(category: str, limit: int | None = None) -> list[dict]:
    """BFCL v4 test entries of a category, the first `limit` of them (deep copies: callers may
    mutate them)."""
    _check_category(category)
    return copy.deepcopy(list(_load_entries_cached(category)[:limit]))


def load_answers(category: str) -> dict[str, dict]:
    """possible_answer entries by id ({} for irrelevance categories, which ship none)."""
    _check_category(category)
    if "irrelevance" in category:
        return {}
    return copy.deepcopy(_load_answers_cached(category))


def _fill_descriptions(props: dict) -> None:
    # BFCL's converter appends to "description" of float parameters; docs outside BFCL may lack one.
    for p in props.values():
        if isinstance(p, dict):
            p.setdefault("description", "")
            if isinstance(p.get("properties"), dict):
                _fill_descriptions(p["properties"])
            items = p.get("items")
            if isinstance(items, dict) and isinstance(items.get("properties"), dict):
                _fill_descriptions(items["properties"])


def func_doc_to_tool(doc: dict) -> dict:
    """One BFCL function doc -> an OpenAI function tool schema, through BFCL's own converter
    (`convert_to_tool` with GORILLA_TO_OPENAPI types: dict->object, float->number plus a "This is a
    float type value." note, tuple->array, any->string). Function names keep their dots (the
    style BFCL uses for models that accept them), so BFCL's checkers see the names unchanged."""
    install_shim()   # bfcl_eval is importable only behind the shim
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool

    doc = copy.deepcopy(doc)
    doc.setdefault("description", "")
    params = doc.setdefault("parameters", {"type": "dict", "properties": {}})
    params.setdefault("properties", {})
    _fill_descriptions(params["properties"])
    # FIREWORK_AI: wraps as {"type": "function", "function": ...} and neither renames nor strips.
    return convert_to_tool([doc], GORILLA_TO_OPENAPI, ModelStyle.FIREWORK_AI)[0]
