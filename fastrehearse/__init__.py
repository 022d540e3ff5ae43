"""fastrehearse: train tool-use LLM agents by world rehearsal (one model, two roles: policy and
environment), with fused Triton loss kernels, packed varlen sequences and an FSDP2 trainer.

Data path (one folder per stage):
    envs/ (tasks) -> rollout/ (episodes, role-tagged tokens) -> packing/ (PackedBatch)
    -> model/ (hidden states) -> kernels (fused loss) + algo/ (advantages) -> train/ (FSDP2, DCP)
    -> eval/
"""
__version__ = "0.1.0"


def _map_source_kernels() -> None:
    """Run from a source checkout (cwd = the repository root, so `python -m` / `torchrun -m` import
    this folder, not the installed package): `fastrehearse.kernels` lives in the top-level
    `kernels/` folder, which the wheel installs as the subpackage. Map that one name there (lazily:
    nothing is imported until it is asked for). An installed package has its own `kernels/` and
    skips this; an editable install's own finder, ahead in sys.meta_path, answers first."""
    # Imported here: at module level they would become attributes of the package (fastrehearse.sys).
    import importlib.abc
    import importlib.util
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    src = here.parent / "kernels"
    if (here / "kernels").is_dir() or not (src / "__init__.py").is_file():
        return

    class _SourceKernels(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "fastrehearse.kernels":
                return None
            return importlib.util.spec_from_file_location(
                name, src / "__init__.py", submodule_search_locations=[str(src)])

    if not any(type(f).__name__ == "_SourceKernels" for f in sys.meta_path):
        sys.meta_path.append(_SourceKernels())


_map_source_kernels()
