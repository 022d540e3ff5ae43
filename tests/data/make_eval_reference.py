"""Record tests/data/eval_reference.json: per-item results of `fastrehearse eval` for one greedy tiny
random model on a few builtin and BFCL items. Recorded ONCE with the pre-engine harness (HF
`generate`, commit e34ad9c) as the regression reference for the engine-based evaluation
(tests/test_eval_engine.py asserts the engine gives the same scores on the same items).

    OMP_NUM_THREADS=1 .venv/bin/python tests/data/make_eval_reference.py
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
# (suite, categories, limit): small and cheap (2-layer hidden-64 model, 32 tokens per turn)
RUNS = [("builtin", ["test", "test:easy:task"], 3),
        ("bfcl", ["simple_python", "multiple", "irrelevance", "multi_turn_base", "multi_turn_miss_func"], 2)]
COMMON = ["--policy", "tiny-llama", "--max-new-tokens", "32", "--seed", "0", "--batch-size", "4", "--quiet"]


def reference_model():
    """The tiny random Llama with a wider init (0.2) than load_model's (0.02), whose greedy output
    is one repeated token: here every position picks a different word, so equal transcripts mean
    equal prompts token for token."""
    from fastrehearse.model import build_tiny_model, load_tokenizer
    from fastrehearse.model.loader import _sync_special_tokens

    tok = load_tokenizer("smollm2")
    model = build_tiny_model("llama", vocab_size=len(tok), seed=0, initializer_range=0.2)
    _sync_special_tokens(model, tok)
    return model, tok


def main() -> None:
    from fastrehearse.eval import cli

    loaded = reference_model()

    out = {"model": "tiny-llama, initializer_range 0.2", "seed": 0, "max_new_tokens": 32, "temperature": 0.0,
           "recorded_with": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                           text=True, cwd=HERE).stdout.strip(),
           "runs": []}
    for suite, cats, limit in RUNS:
        with tempfile.TemporaryDirectory() as d:
            res = cli.run(cli.build_parser().parse_args(
                ["--suite", suite, "--categories", *cats, "--limit", str(limit), "--out", d] + COMMON), loaded=loaded)
            items = [json.loads(line) for line in open(Path(d) / "items.jsonl")]
        out["runs"].append({
            "suite": suite, "categories": cats, "limit": limit, "overall": res["overall"],
            "items": [{"category": r["category"], "id": r["id"], "score": r["score"], "error": r["error"],
                       "steps": r["steps"], "real_calls": r["real_calls"], "malformed": r["malformed"],
                       # every assistant turn as the harness saw it (clipped at 400 characters)
                       "assistant_turns": [m.get("content") for m in r["extra"]["transcript"]
                                           if m["role"] == "assistant"]}
                      for r in items]})
    path = HERE / "eval_reference.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
