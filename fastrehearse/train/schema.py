"""The trainer's configuration schema: plain dataclasses, one per section of the YAML.

Components own their configs and the train config nests them (torchtitan's per-component
configs): `rollout` holds the rollout engine's own RolloutConfig beside the keys only the trainer
uses, `algo.advantage` is fastrehearse.algo's AdvantageConfig, `algo.loss` the kernel's
PolicyLossConfig, `algo.world_reward` the reward's WorldRewardConfig, `model.options` the loader's
TinyModelOptions. Loading, `--set` overrides and checks: fastrehearse/train/config.py; which keys
may change on resume: fastrehearse/train/run_dir.py.

A choice is written as a Literal annotation (checked as the key is read); a component's own value
rules are its `validate()` (the kernel's PolicyLossConfig checks each field as it is set); ranges
and rules across sections are the loader's `validate`.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field

from fastrehearse.algo.advantages import AdvantageConfig
from fastrehearse.algo.aggregation import AGGREGATIONS
from fastrehearse.algo.rewards import WorldRewardConfig
from fastrehearse.kernels import BACKENDS as KERNEL_BACKENDS
from fastrehearse.kernels import PolicyLossConfig
from fastrehearse.model.loader import TinyModelOptions
from fastrehearse.rollout.config import MODES as ROLLOUT_MODES
from fastrehearse.rollout.config import RolloutConfig

PRECISIONS = ("auto", "fp32", "bf16")

# Field metadata of a nested component whose keys are written directly in the enclosing section
# (`rollout.mode`, not `rollout.engine.mode`): the loader, `to_dict` and docs/config.md splice them in.
INLINE = {"inline": True}


@dataclass
class ModelConfig:
    # A local HF directory, a .gguf file, "smollm2" (the embedded SmolLM2-135M-Instruct GGUF), or a
    # tiny random config for tests: "tiny-llama" | "tiny-qwen2" | "tiny-qwen3".
    spec: str = "smollm2"
    # auto: bf16 params / fp32 gradient reduction on CUDA, fp32 everywhere on CPU.
    precision: typing.Literal[PRECISIONS] = "auto"
    activation_checkpointing: bool = False
    # fastrehearse.kernels backend of every LM-head call (RL loss, SFT CE, old / reference
    # log-probs): auto (triton on CUDA, torch on CPU) | torch | triton | triton-fused (the no-grad
    # old / reference log-probs through the tl.dot + log-sum-exp tile kernel; not with an LM-head
    # bias or soft-cap). May change on resume (same math, different kernels).
    kernel_backend: typing.Literal[KERNEL_BACKENDS] = "auto"
    # Sizes of a tiny-* model (fastrehearse.model.TinyModelOptions); other specs take none.
    options: TinyModelOptions = field(default_factory=TinyModelOptions)


@dataclass
class EnvConfig:
    # A registry name (builtin | bfcl | tau2 | mcp) or an import path "package.module:Class" naming
    # a fastrehearse.envs.Suite subclass (your own tools; docs/envs.md).
    suite: str = "builtin"
    # Keyword arguments of the suite's constructor (fastrehearse.envs.get_suite): names and simple
    # types are checked against its signature at start; values by the suite, also before the model loads.
    options: dict = field(default_factory=dict)
    train_split: str = "train"
    eval_split: str = "test"
    max_train_tasks: int | None = None
    # Task reward of training rollouts (fastrehearse.algo.rewards; docs/training.md "Rewards"): real
    # (env.score) | consistent (graded inside the episode's own, possibly rehearsed, world) | calls.
    # Evaluation always scores real.
    reward: typing.Literal["real", "consistent", "calls"] = "real"


@dataclass
class TrainRolloutConfig:
    """Training rollouts: every key of the rollout engine's RolloutConfig (fastrehearse.rollout),
    written directly under `rollout`, beside the keys only the trainer uses. RL rollouts also score
    the world model by default (measure_fidelity true)."""
    engine: RolloutConfig = field(default_factory=lambda: RolloutConfig(measure_fidelity=True),
                                  metadata=INLINE)
    group_size: int = 4             # samples per task (the GRPO group)
    tasks_per_step: int = 4         # tasks per RL step over all ranks (split evenly)
    # training reward of an episode with a malformed call (None: its score), applied by
    # fastrehearse.algo.rewards; the engine only reports the score and metadata["malformed"]
    malformed_reward: float | None = 0.0


@dataclass
class EvalConfig:
    """Held-out evaluation before and after training (the final table)."""
    num_tasks: int = 16             # tasks of env.eval_split
    mode: typing.Literal[ROLLOUT_MODES] = "real"   # how success is measured (real: tools executed)
    temperature: float = 0.0        # greedy
    fidelity: bool = True           # extra rehearse-mode pass scoring rehearsed vs real responses
    before: bool = True
    after: bool = True
    # Held-out eval every N optimizer steps (SFT steps count) as metrics rows (stage "eval"); the
    # checkpoint with the best held-out success is kept and named in summary.json. 0: off.
    every: int = 0


@dataclass
class AlgoConfig:
    # Role-wise GRPO advantages (fastrehearse.algo.compute_advantages takes this section as it is).
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    aggregation: typing.Literal[AGGREGATIONS] = "token-mean"
    norm_len: float | None = None   # Dr. GRPO constant (default: rollout.max_episode_tokens)
    updates_per_batch: int = 1      # optimizer steps per rollout batch (1 = strictly on-policy)
    # The kernel's own config. loss.temperature follows rollout.temperature unless set (then it
    # must equal it: the importance ratio compares log-probs of the same tempered distribution).
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    # The REHEARSE role's reward (fastrehearse.algo.rewards): mode task | world (format + grounded).
    world_reward: WorldRewardConfig = field(default_factory=WorldRewardConfig)
    hybrid_baseline: typing.Literal["strata", "pooled"] = "strata"   # hybrid ACT baseline per stratum
    # Truncated importance sampling for the rollout/trainer mismatch (fastrehearse.algo.tis): each
    # sampled token's policy-gradient term (not KL / entropy) is weighted by
    # min(pi_trainer_old / pi_rollout, tis_cap). Applied with rollout.backend=vllm; null: off.
    tis_cap: float | None = 2.0
    # Sequence-level IS beside the token cap (fastrehearse.algo.tis.sequence_weights): per episode,
    # r = exp(sum over its sampled tokens of (old - rollout)); "truncate": its policy-gradient terms
    # weighted by min(r, tis_sequence_cap); "mask": an episode with r outside
    # [1 / tis_sequence_cap, tis_sequence_cap] trains no policy-gradient term. null: off.
    tis_sequence: typing.Optional[typing.Literal["truncate", "mask"]] = None
    tis_sequence_cap: float = 2.0


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1       # cosine decays to lr * min_lr_ratio at the last step
    grad_clip: float = 1.0          # max global grad norm (0 = off)
    # Keep a copy of the parameters and Adam moments across each optimizer step, so an update that
    # leaves a non-finite weight is rolled back and counted as a skipped step (costs one extra copy
    # of params + moments per rank; off: such an update stops training with an error instead).
    rollback_nonfinite: bool = True


@dataclass
class SFTConfig:
    """Optional SFT steps before RL: CE on ACT (and OBSERVED / REHEARSE) tokens.
    source gold: the tasks' gold trajectories (the warm-up; tool responses real, OBSERVED).
    source own_rehearsals (the learning experiment's Sr control, docs/training.md): each step
    samples the model's own episodes exactly as an RL step would (rollout.tasks_per_step x
    group_size from the RL task stream, rollout.mode rehearse, the RL step seed), keeps those whose
    env.reward (consistent) is 1, and trains CE on their ACT and REHEARSE tokens."""
    steps: int = 0
    source: typing.Literal["gold", "own_rehearsals"] = "gold"
    tasks_per_step: int = 8         # gold source only (own_rehearsals uses rollout.tasks_per_step)
    lr: float = 1e-4
    warmup_steps: int = 0
    w_act: float = 1.0
    w_observed: float = 1.0         # the world model learns tool responses from real ones
    w_rehearse: float = 1.0         # own_rehearsals: the world model learns its own kept rehearsals


@dataclass
class CheckpointConfig:
    every: int = 0                  # save every K RL steps (0 = only on SIGTERM and at the end)
    keep: int = 2                   # complete checkpoints kept (older ones are deleted)
    at_end: bool = True
    export: bool = True             # HF safetensors + config + tokenizer in run_dir/export


@dataclass
class LogConfig:
    progress: bool = True           # tqdm progress bar (rank 0)
    plot_every: int = 1             # refresh the PNG every K steps (0 = only at the end)
    tensorboard: bool = False       # run_dir/tb via torch.utils.tensorboard (needs `tensorboard`)
    wandb: bool = False             # used only when installed
    wandb_project: str = "fastrehearse"


@dataclass
class DistConfig:
    # Every collective's limit: a rank waiting longer for a peer (alive but stuck, or gone without
    # closing its connection) raises and the job stops. Above the longest normal wait between two
    # collectives -- one rank's rollout while the others wait to gather episodes, vLLM start-up,
    # rank 0's export; raise it for long HF rollouts at large models.
    timeout_s: float = 1800.0


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    steps: int = 10                 # RL steps (rollout batches)
    max_tokens: int = 4096          # token budget of one packed micro-batch
    device: typing.Literal["auto", "cpu", "cuda"] = "auto"
    max_consecutive_skips: int = 3  # non-finite steps in a row before giving up
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: TrainRolloutConfig = field(default_factory=TrainRolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)
