"""Config presets (YAML). Installed as the package `fastrehearse.configs` (see setup.py), so a pip
install has them: importlib.resources.files("fastrehearse.configs") / "demo.yaml"."""
