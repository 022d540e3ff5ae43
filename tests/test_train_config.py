"""Config loading: YAML + --set overrides, strict keys and types, clear messages."""
from pathlib import Path

import pytest

from fastrehearse.train.config import ConfigError, TrainConfig, apply_override, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_nested_yaml(tmp_path):
    cfg = load_config(_yaml(tmp_path, "steps: 3\nalgo:\n  leave_one_out: true\n  loss:\n    clip_high: 0.28\n"
                                      "optim:\n  lr: 1\n"))
    assert isinstance(cfg, TrainConfig)
    assert cfg.steps == 3 and cfg.algo.leave_one_out is True and cfg.algo.loss.clip_high == 0.28
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)   # int accepted for float
    assert cfg.algo.std_normalize is False                             # paper default


def test_overrides(tmp_path):
    cfg = load_config(_yaml(tmp_path, "steps: 3\n"),
                      ["optim.lr=3e-5", "algo.loss.dual_clip=3", "rollout.mode=hybrid",
                       "optim.betas=[0.9, 0.95]", "env.options={level: easy}", "algo.norm_len=null"])
    assert cfg.optim.lr == 3e-5 and cfg.algo.loss.dual_clip == 3.0
    assert cfg.rollout.mode == "hybrid" and cfg.optim.betas == [0.9, 0.95]
    assert cfg.env.options == {"level": "easy"} and cfg.algo.norm_len is None


def test_unknown_key_names_key_and_allowed(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "algo:\n  aggregaton: token-mean\n"))
    msg = str(e.value)
    assert "'algo.aggregaton'" in msg and "did you mean 'aggregation'" in msg
    assert "leave_one_out" in msg and "std_normalize" in msg           # the allowed keys
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rate'.*allowed keys"):
        load_config(None, ["optim.learning_rate=1e-5"])
    with pytest.raises(ConfigError, match="unknown config key 'bogus'"):
        load_config(_yaml(tmp_path, "bogus: 1\n"))


def test_mistyped_values(tmp_path):
    with pytest.raises(ConfigError, match=r"'optim.lr' must be float, got 'fast' \(str\)"):
        load_config(None, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"'steps' must be int, got 2.5"):
        load_config(_yaml(tmp_path, "steps: 2.5\n"))
    with pytest.raises(ConfigError, match=r"'algo.std_normalize' must be bool, got 'yes please'"):
        load_config(None, ["algo.std_normalize=yes please"])
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
    from fastrehearse.train.config import resume_changes, to_dict
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
    assert cfg.algo.tis_cap == 2.0 and cfg.rollout.backend == "vllm"
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
    p.write_text("algo:\n  turn_reward_coef: 1.0\n  leave_one_out: true\n")
    assert load_config(p).algo.leave_one_out is True
    p.write_text("algo:\n  turn_reward_coef: 0.5\n")
    with pytest.raises(ConfigError, match=r"'algo.turn_reward_coef' was removed: .*never changed a run"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"'algo.turn_reward_coef' was removed"):
        load_config(None, ["algo.turn_reward_coef=2"])
    assert load_config(None, ["algo.turn_reward_coef=1.0"]).algo.leave_one_out is False


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
    assert cfg.rollout.backend == "vllm" and cfg.rollout.vllm.tensor_parallel_size == 1


def test_separate_rehearsal_is_not_a_training_setting():
    """rehearsal='separate' is the rollout benchmark's baseline: refused in training in one line."""
    with pytest.raises(ConfigError, match=r"'rollout.rehearsal' = 'separate': training rehearses inline"):
        load_config(CONFIGS / "smoke.yaml", ["rollout.rehearsal=separate"])
