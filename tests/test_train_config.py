"""Config loading: YAML + --set overrides, strict keys and types, clear messages."""
from pathlib import Path

import pytest
import yaml

from fastrehearse.algo import AdvantageConfig
from fastrehearse.rollout.config import RolloutConfig
from fastrehearse.train.config import (
    ConfigError,
    TrainConfig,
    apply_override,
    dump_config,
    from_dict,
    load_config,
    to_dict,
)
from fastrehearse.train.run_dir import _check_run_dir, resume_changes

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_nested_yaml(tmp_path):
    cfg = load_config(_yaml(tmp_path, "steps: 3\nalgo:\n  advantage: {leave_one_out: true}\n  loss:\n"
                                      "    clip_high: 0.28\noptim:\n  lr: 1\n"))
    assert isinstance(cfg, TrainConfig)
    assert cfg.steps == 3 and cfg.algo.advantage.leave_one_out is True and cfg.algo.loss.clip_high == 0.28
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)   # int accepted for float
    assert cfg.algo.advantage.std_normalize is False                   # paper default


def test_overrides(tmp_path):
    cfg = load_config(_yaml(tmp_path, "steps: 3\n"),
                      ["optim.lr=3e-5", "algo.loss.dual_clip=3", "rollout.mode=hybrid",
                       "optim.betas=[0.9, 0.95]", "env.options={level: easy}", "algo.norm_len=null"])
    assert cfg.optim.lr == 3e-5 and cfg.algo.loss.dual_clip == 3.0
    assert cfg.rollout.engine.mode == "hybrid" and cfg.optim.betas == [0.9, 0.95]
    assert cfg.env.options == {"level": "easy"} and cfg.algo.norm_len is None


def test_unknown_key_names_key_and_allowed(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "algo:\n  aggregaton: token-mean\n"))
    msg = str(e.value)
    assert "'algo.aggregaton'" in msg and "did you mean 'aggregation'" in msg
    assert "advantage" in msg and "tis_cap" in msg                     # the allowed keys
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rate'.*allowed keys"):
        load_config(None, ["optim.learning_rate=1e-5"])
    with pytest.raises(ConfigError, match="unknown config key 'bogus'"):
        load_config(_yaml(tmp_path, "bogus: 1\n"))


def test_mistyped_values(tmp_path):
    with pytest.raises(ConfigError, match=r"'optim.lr' must be float, got 'fast' \(str\)"):
        load_config(None, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"'steps' must be int, got 2.5"):
        load_config(_yaml(tmp_path, "steps: 2.5\n"))
    with pytest.raises(ConfigError, match=r"'algo.advantage.std_normalize' must be bool, got 'yes please'"):
        load_config(None, ["algo.advantage.std_normalize=yes please"])
    with pytest.raises(ConfigError, match=r"'algo' must be a mapping"):
        load_config(_yaml(tmp_path, "algo: 3\n"))
    with pytest.raises(ConfigError, match=r"'steps' is a int, not a section"):
        load_config(None, ["steps.x=1"])
    with pytest.raises(ConfigError, match="--set expects key=value"):
        load_config(None, ["steps"])


def test_value_checks():
    with pytest.raises(ConfigError, match=r"'rollout.mode' = 'dream' is not one of \['rehearse', 'real', 'hybrid'\]"):
        load_config(None, ["rollout.mode=dream"])
    with pytest.raises(ConfigError, match=r"'algo.aggregation' = 'mean'"):
        load_config(None, ["algo.aggregation=mean"])
    with pytest.raises(ConfigError, match=r"'rollout.group_size' must be > 0"):
        load_config(None, ["rollout.group_size=0"])
    with pytest.raises(ConfigError, match=r"'dist.timeout_s' must be > 0"):
        load_config(None, ["dist.timeout_s=0"])
    assert load_config(None, ["dist.timeout_s=45"]).dist.timeout_s == 45.0
    # the kernel's PolicyLossConfig checks its own fields; the message names the train config key
    with pytest.raises(ConfigError, match=r"'algo.loss.dual_clip'.*dual_clip.*0\.5"):
        load_config(None, ["algo.loss.dual_clip=0.5"])
    with pytest.raises(ConfigError, match=r"'max_tokens' \(100\) must be >= 'rollout.max_episode_tokens'"):
        load_config(None, ["max_tokens=100"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: '.*nope.yaml'"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(_yaml(tmp_path, "steps: [1,\n"))


def test_apply_override_section_merge():
    cfg = TrainConfig()
    apply_override(cfg, "sft={steps: 5}")
    assert cfg.sft.steps == 5 and cfg.sft.w_act == 1.0   # other keys of the section kept


@pytest.mark.parametrize("name", ["smoke.yaml", "demo.yaml", "qwen3_1p7b_builtin.yaml", "qwen3_8b_bfcl.yaml"])
def test_presets_load(name):
    if not (CONFIGS / name).is_file():
        pytest.skip(f"{name} not written yet")
    load_config(CONFIGS / name)


def test_kernel_backend(monkeypatch):
    """model.kernel_backend: a choice of the kernels' backends; a Triton one on the CPU needs the
    interpreter (refused before any work otherwise); it may change on resume."""
    with pytest.raises(ConfigError, match=r"'model.kernel_backend' = 'cuda' is not one of "
                                          r"\['auto', 'torch', 'triton', 'triton-fused'\]"):
        load_config(None, ["model.kernel_backend=cuda"])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"'model.kernel_backend' = 'triton-fused': .*needs CUDA tensors "
                                          r"or TRITON_INTERPRET=1.*\(this run is on the CPU\)"):
        load_config(None, ["model.kernel_backend=triton-fused", "device=cpu"])
    import fastrehearse.kernels._common as kc
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "1")
        m.setattr(kc, "triton_missing", lambda: "No module named 'triton'")
        with pytest.raises(ConfigError, match=r"'model.kernel_backend' = 'triton': .*needs the triton "
                                              r"package \(No module named 'triton'\)"):
            load_config(None, ["model.kernel_backend=triton", "device=cpu"])
    assert load_config(None, ["model.kernel_backend=torch", "device=cpu"]).model.kernel_backend == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = load_config(None, ["model.kernel_backend=triton-fused", "device=cpu"])
    allowed, forbidden = resume_changes(to_dict(TrainConfig()), to_dict(cfg))
    assert [k for k, *_ in allowed] == ["device", "model.kernel_backend"] and not forbidden


def test_task_reward_the_suite_cannot_compute_is_refused_before_loading():
    from fastrehearse.train.config import preflight
    preflight(load_config("configs/smoke.yaml", ["env.reward=consistent"]))     # builtin has it
    cfg = load_config("configs/qwen3_8b_tau2_telecom.yaml", ["env.reward=consistent", "model.spec=tiny-llama"])
    with pytest.raises(ConfigError, match=r"'env.reward'.*consistent.*suite 'tau2' has only \['real'\]"):
        preflight(cfg)


@pytest.mark.parametrize("preset", ["qwen3_1p7b_builtin.yaml", "qwen3_8b_bfcl.yaml",
                                    "qwen3_8b_bfcl_multi_turn.yaml", "qwen3_8b_tau2_telecom.yaml"])
def test_every_gpu_preset_loads_with_vllm_and_truncated_is(preset):
    """Truncated IS weights the policy-gradient term alone (the kernel's pg_weights), so a KL
    term or entropy bonus coexists with it: every GPU preset loads with rollout.backend=vllm
    (they were all refused: the weights rode on token_weights, which scale KL too)."""
    cfg = load_config(CONFIGS / preset, ["rollout.backend=vllm"])
    assert cfg.algo.tis_cap == 2.0 and cfg.rollout.engine.backend == "vllm"
    assert cfg.algo.loss.kl_coef > 0 or preset.startswith("qwen3_1p7b")


def test_tis_cap_checks():
    """A cap must be > 0; null turns it off."""
    assert load_config(CONFIGS / "smoke.yaml", ["rollout.backend=vllm",
                                               "algo.loss.kl_coef=0.01"]).algo.tis_cap == 2.0
    with pytest.raises(ConfigError, match=r"'algo.tis_cap' must be > 0"):
        load_config(CONFIGS / "smoke.yaml", ["algo.tis_cap=0"])
    assert load_config(CONFIGS / "smoke.yaml", ["rollout.backend=vllm", "algo.tis_cap=null"]).algo.tis_cap is None
    assert load_config(CONFIGS / "smoke.yaml", ["algo.loss.entropy_coef=0"]).algo.tis_cap == 2.0


def test_removed_key_that_did_nothing(tmp_path):
    """algo.turn_reward_coef acted on turn rewards nothing in the trainer produces: gone. Its old
    default still loads (a reused run_dir config.yaml), any other value is refused saying why."""
    from fastrehearse.train.config import AlgoConfig
    assert "turn_reward_coef" not in AlgoConfig.__dataclass_fields__
    p = tmp_path / "c.yaml"
    p.write_text("algo:\n  turn_reward_coef: 1.0\n  advantage: {leave_one_out: true}\n")
    assert load_config(p).algo.advantage.leave_one_out is True
    p.write_text("algo:\n  turn_reward_coef: 0.5\n")
    with pytest.raises(ConfigError, match=r"'algo.turn_reward_coef' was removed: .*never changed a run"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"'algo.turn_reward_coef' was removed"):
        load_config(None, ["algo.turn_reward_coef=2"])
    assert load_config(None, ["algo.turn_reward_coef=1.0"]).algo.advantage.leave_one_out is False
    # AdvantageConfig's own field is no trainer key either: not written, refused unless its default
    assert "turn_reward_coef" not in to_dict(load_config(None))["algo"]["advantage"]
    with pytest.raises(ConfigError, match=r"'algo.advantage.turn_reward_coef' was removed"):
        load_config(None, ["algo.advantage.turn_reward_coef=0.5"])


def test_sequence_level_is_settings():
    """algo.tis_sequence: truncate | mask | null; a mask needs a cap > 1; a bad mode is named."""
    cfg = load_config(CONFIGS / "smoke.yaml", ["rollout.backend=vllm", "algo.tis_sequence=mask",
                                               "algo.tis_sequence_cap=3.0"])
    assert (cfg.algo.tis_sequence, cfg.algo.tis_sequence_cap) == ("mask", 3.0)
    with pytest.raises(ConfigError, match=r"'algo.tis_sequence' must be one of \['truncate', 'mask'\] or None, got 'geometric'"):
        load_config(CONFIGS / "smoke.yaml", ["algo.tis_sequence=geometric"])
    with pytest.raises(ConfigError, match=r"'algo.tis_sequence_cap' must be > 1 with tis_sequence=mask"):
        load_config(CONFIGS / "smoke.yaml", ["algo.tis_sequence=mask", "algo.tis_sequence_cap=1.0"])


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_preset_validates_with_vllm(preset):
    """Every preset in configs/ loads and validates with rollout.backend=vllm (the model's own
    servability -- e.g. vLLM-CPU's head sizes -- is checked when the engine starts)."""
    cfg = load_config(CONFIGS / preset, ["rollout.backend=vllm"])
    assert cfg.rollout.engine.backend == "vllm" and cfg.rollout.engine.vllm.tensor_parallel_size == 1


def test_rehearsal_key_is_gone(tmp_path, capsys):
    """rollout.rehearsal is no key: training always rehearses inline, and the separate-simulator
    baseline is the rollout benchmark's (benchmarks/bench_rollout.py). 'inline' (what every run
    does) loads with a one-line notice; 'separate' is refused in one line naming the benchmark."""
    assert "rehearsal" not in RolloutConfig.__dataclass_fields__
    notice = ("fastrehearse: config key 'rollout.rehearsal' was removed; its old default 'inline' is "
              "what every run does (ignored: delete it from the config)")
    p = _yaml(tmp_path, "rollout:\n  rehearsal: inline\n  max_turns: 3\n")
    assert to_dict(load_config(p)) == to_dict(load_config(None, ["rollout.max_turns=3"]))
    assert capsys.readouterr().err.splitlines() == [notice]
    load_config(None, ["rollout.rehearsal=inline"])
    assert capsys.readouterr().err.splitlines() == [notice]
    for cfg in (_yaml(tmp_path, "rollout:\n  rehearsal: separate\n"), None):
        with pytest.raises(ConfigError) as e:
            load_config(cfg, [] if cfg else ["rollout.rehearsal=separate"])
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("config key 'rollout.rehearsal' was removed: 'separate'")
        assert "benchmarks/bench_rollout.py" in msg and "(got 'separate')" in msg
    assert "rehearsal" not in to_dict(load_config(None))["rollout"]


def test_resume_reads_a_saved_config_with_the_rehearsal_key(tmp_path):
    """A run saved while rollout.rehearsal was a key (its config.yaml says `rehearsal: inline`)
    resumes: the key compares as unchanged, and a real change beside it is still refused."""
    cfg = load_config(None, [f"run_dir={tmp_path}"])
    step = tmp_path / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    old = to_dict(cfg)
    old["rollout"] = {**old["rollout"], "rehearsal": "inline"}
    (step / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    assert resume_changes(old, to_dict(cfg)) == ([], [])
    assert _check_run_dir(cfg, resume=True, overwrite=False) == []
    assert to_dict(load_config(step / "config.yaml")) == to_dict(cfg)     # the saved file loads too
    changed = load_config(None, [f"run_dir={tmp_path}", "rollout.max_turns=2"])
    with pytest.raises(ConfigError, match=r"--resume cannot change 'rollout.max_turns' 6 -> 2"):
        _check_run_dir(changed, resume=True, overwrite=False)


OLD_PATHS = "algo:\n  std_normalize: true\n  leave_one_out: true\n  world_reward: {mode: world, gate: act_signal}\n"
NEW_PATHS = ("algo:\n  advantage: {std_normalize: true, leave_one_out: true, gate_rehearse_on_act: true}\n"
             "  world_reward: {mode: world}\n")


def test_advantage_settings_at_their_old_flat_paths(tmp_path, capsys):
    """The advantage settings live in algo.advantage (fastrehearse.algo's AdvantageConfig, passed to
    compute_advantages as it is); configs written with algo.std_normalize / algo.leave_one_out /
    algo.world_reward.gate load the same, each with a one-line notice naming both paths."""
    old = load_config(_yaml(tmp_path, OLD_PATHS))
    assert capsys.readouterr().err.splitlines() == [
        "fastrehearse: config key 'algo.std_normalize' is now 'algo.advantage.std_normalize' (read as that; "
        "write the new path)",
        "fastrehearse: config key 'algo.leave_one_out' is now 'algo.advantage.leave_one_out' (read as that; "
        "write the new path)",
        "fastrehearse: config key 'algo.world_reward.gate: act_signal' is now "
        "'algo.advantage.gate_rehearse_on_act: true' (read as that; write the new path)"]
    assert old.algo.advantage == AdvantageConfig(std_normalize=True, leave_one_out=True, gate_rehearse_on_act=True)
    assert to_dict(old) == to_dict(load_config(_yaml(tmp_path, NEW_PATHS)))
    assert capsys.readouterr().err == ""                       # the new paths: no notice
    # --set, one key or a section mapping
    cfg = load_config(None, ["algo.leave_one_out=true", "algo.world_reward={mode: world, gate: none}"])
    assert (cfg.algo.advantage.leave_one_out, cfg.algo.advantage.gate_rehearse_on_act) == (True, False)
    assert cfg.algo.world_reward.mode == "world"
    assert len(capsys.readouterr().err.splitlines()) == 2
    with pytest.raises(ConfigError, match=r"'algo.world_reward.gate' = 'act' is not one of \['none', 'act_signal'\]"):
        load_config(None, ["algo.world_reward.gate=act"])
    with pytest.raises(ConfigError, match=r"'algo.leave_one_out' moved to 'algo.advantage.leave_one_out', and both are set"):
        load_config(_yaml(tmp_path, "algo:\n  leave_one_out: true\n  advantage: {leave_one_out: false}\n"))
    with pytest.raises(ConfigError, match=r"unknown config key 'algo.world_reward.gate_x'"):
        load_config(_yaml(tmp_path, "algo:\n  world_reward: {gate: none, gate_x: 1}\n"))


def _old_layout(d: dict) -> dict:
    """A config.yaml as runs wrote it before the advantage settings moved to algo.advantage."""
    adv = d["algo"].pop("advantage")
    d["algo"] = {"std_normalize": adv["std_normalize"], "leave_one_out": adv["leave_one_out"],
                 "turn_reward_coef": 1.0, **d["algo"]}
    d["algo"]["world_reward"]["gate"] = "act_signal" if adv["gate_rehearse_on_act"] else "none"
    return d


def test_resume_reads_a_saved_config_in_the_old_layout(tmp_path):
    """--resume compares configs key by key: a checkpoint whose config.yaml has the advantage keys at
    their old paths compares equal to the same run's config at the new ones; a real change to one
    of them is still refused, named by its new path."""
    cfg = load_config(None, [f"run_dir={tmp_path}", "algo.advantage.leave_one_out=true"])
    step = tmp_path / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    dump_config(cfg, step / "config.yaml")
    old = _old_layout(yaml.safe_load((step / "config.yaml").read_text()))
    assert "advantage" not in old["algo"] and old["algo"]["leave_one_out"] is True
    (step / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    assert resume_changes(old, to_dict(cfg)) == ([], [])
    assert _check_run_dir(cfg, resume=True, overwrite=False) == []
    for change, key, was, now in (("algo.advantage.leave_one_out=false", "algo.advantage.leave_one_out", True, False),
                                  ("algo.advantage.gate_rehearse_on_act=true", "algo.advantage.gate_rehearse_on_act",
                                   False, True),
                                  ("algo.advantage.std_normalize=true", "algo.advantage.std_normalize", False, True)):
        changed = load_config(None, [f"run_dir={tmp_path}", "algo.advantage.leave_one_out=true", change])
        assert resume_changes(old, to_dict(changed)) == ([], [(key, was, now)])
        with pytest.raises(ConfigError, match=rf"--resume cannot change '{key}' {was} -> {now}"):
            _check_run_dir(changed, resume=True, overwrite=False)
    # an allowed change is still announced
    more = load_config(None, [f"run_dir={tmp_path}", "algo.advantage.leave_one_out=true", "steps=20"])
    assert _check_run_dir(more, resume=True, overwrite=False) == ["--resume: 'steps' changed 10 -> 20 (takes "
                                                                  "effect from step 2)"]


def test_rollout_section_composes_the_engine_config():
    """`rollout` is the engine's RolloutConfig (cfg.rollout.engine) beside the trainer-only keys,
    written at the same `rollout.*` paths; the trainer's defaults hold however the section is given."""
    cfg = load_config(None, ["rollout.mode=hybrid", "rollout.group_size=2", "rollout.vllm.kv_cache_gib=3"])
    assert type(cfg.rollout.engine) is RolloutConfig and cfg.rollout.group_size == 2
    assert (cfg.rollout.engine.mode, cfg.rollout.engine.vllm.kv_cache_gib) == ("hybrid", 3)
    assert cfg.rollout.engine.measure_fidelity is True           # RL rollouts score the world model
    section = to_dict(cfg)["rollout"]
    assert "engine" not in section and section["mode"] == "hybrid" and section["group_size"] == 2
    assert list(section)[-3:] == ["group_size", "tasks_per_step", "malformed_reward"]
    for given in ({"rollout": {"mode": "real"}}, {"rollout": {"tasks_per_step": 8}}):
        assert from_dict(TrainConfig, given).rollout.engine.measure_fidelity is True
    cfg = TrainConfig()
    apply_override(cfg, "rollout={max_turns: 3, tasks_per_step: 6}")
    assert (cfg.rollout.engine.max_turns, cfg.rollout.tasks_per_step, cfg.rollout.engine.measure_fidelity) == (3, 6, True)
    with pytest.raises(ConfigError, match=r"'rollout.mode' = 'dream' is not one of \['rehearse', 'real', 'hybrid'\]"):
        load_config(None, ["rollout.mode=dream"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.max_turn' \(did you mean 'max_turns'\?\)"):
        load_config(None, ["rollout.max_turn=3"])


def test_loss_temperature_follows_or_must_equal_the_rollout_temperature():
    assert load_config(None, ["rollout.temperature=0.7"]).algo.loss.temperature == 0.7
    assert load_config(None, ["rollout.temperature=0.7", "algo.loss.temperature=0.7"]).algo.loss.temperature == 0.7
    with pytest.raises(ConfigError, match=r"'algo.loss.temperature' \(0.5\) must equal 'rollout.temperature' \(0.7\)"):
        load_config(None, ["rollout.temperature=0.7", "algo.loss.temperature=0.5"])
    with pytest.raises(ConfigError, match=r"'rollout.temperature' must be > 0, got 0.0"):
        load_config(None, ["rollout.temperature=0"])


def test_component_checks_name_their_section():
    """A component's own rules are its validate(), run on the assembled config (after every --set)."""
    with pytest.raises(ConfigError, match=r"config section 'rollout': RolloutConfig.max_turns must be >= 1, got 0"):
        load_config(None, ["rollout.max_turns=0"])
    with pytest.raises(ConfigError, match=r"config section 'rollout': RolloutConfig.vllm.kv_cache_gib"):
        load_config(None, ["rollout.vllm.kv_cache_gib=0"])
    with pytest.raises(ConfigError, match=r"config section 'model.options': hidden_size \(30\) must be a multiple"):
        load_config(None, ["model.spec=tiny-llama", "model.options.hidden_size=30"])
    with pytest.raises(ConfigError, match=r"'algo.advantage.eps' must be > 0, got 0.0"):
        load_config(None, ["algo.advantage.eps=0"])


def test_malformed_reward_is_the_trainers_and_reaches_assign_rewards(monkeypatch):
    """`rollout.malformed_reward` (the key path users write) lives in the trainer's rollout section,
    not in the engine's config, and is what the trainer's rewards apply."""
    from types import SimpleNamespace

    from fastrehearse.rollout.config import RolloutConfig
    from fastrehearse.train import rollouts
    cfg = load_config(None, ["rollout.malformed_reward=-0.5"])
    assert cfg.rollout.malformed_reward == -0.5 and "malformed_reward" not in RolloutConfig.__dataclass_fields__
    seen = {}
    monkeypatch.setattr(rollouts, "assign_rewards", lambda *a, **k: seen.update(k) or [])
    rollouts._rewards(SimpleNamespace(cfg=cfg, suite=None), SimpleNamespace(episodes=[], trajectories=[]), [], "rehearse")
    assert seen["malformed_reward"] == -0.5
    assert load_config(None, ["rollout.malformed_reward=null"]).rollout.malformed_reward is None
