"""Role-wise GRPO advantages (plain torch).

World rehearsal trains one model in two roles, so each role gets its own baseline. For a task group
g (the episodes of one task id sampled in this step) and a role r in {ACT, REHEARSE}, let g_r be the
episodes of g that hold at least one token of role r (the episodes in which that role acted):

    R_i^r = role_rewards[r] if episode i overrides role r, else reward_i
    b_i^r = mean_{j in g_r} R_j^r               (default: the GRPO group mean)
          = mean_{j in g_r, j != i} R_j^r       (leave_one_out: the RLOO baseline)
    A_i^r = R_i^r - b_i^r                       (i in g_r)
    A_i^r = A_i^r / (std_{j in g_r} R_j^r + eps)  (std_normalize; off by default, as in the paper's
                                                 code and Dr. GRPO: it up-weights near-solved groups)

Why g_r and not g: in hybrid rollouts some episodes execute every call for real and hold no
REHEARSE token. Pooling their rewards into the REHEARSE baseline compared rehearsals against
episodes that never rehearsed: with a real-value answer check (real episodes reward 1, rehearsed
ones 0) every rehearsal got a negative advantage whatever its quality, and the world model
collapsed (docs/learning.md measured rollout fidelity 0.5 -> 0 in 4 steps). A role is compared
only with the same role on the same task.

`std` is the unbiased sample std (torch.std, as verl). A role that acted in fewer than two episodes
of a group has no baseline and gets advantage 0 (no learning signal; verl would use the raw reward
there).

Per-token broadcast: every token of episode i whose own role is r gets A_i^r (one list per
episode, aligned with Episode.input_ids; packing shifts by one to the target). CONTEXT and OBSERVED
tokens get 0 (OBSERVED is trained by supervised CE, not by advantage). `compute_advantages` returns
them and changes no episode; `with_advantages` makes the episodes packing reads.

Hybrid strata: when episodes carry metadata["stratum"] (fastrehearse.algo.rewards tags hybrid
episodes "real" / "rehearsed"), ACT's g is split by stratum: ACT is compared only with episodes of
the same task whose calls were executed the same way. Other roles keep the task group.

Gating the world model on ACT signal (`gate_rehearse_on_act`; config
`algo.advantage.gate_rehearse_on_act`): in a task group where ACT has no signal (every ACT stratum's
rewards equal, or a single member) REHEARSE gets advantage 0 too. Why:
with a world-model reward of its own (mode "world") REHEARSE keeps a gradient when the task reward
pays nothing; through the shared weights that gradient alone moved the learning experiment's
rehearse arm into malformed calls on seeds whose task reward was 0 everywhere (docs/learning.md).
Gated, the world model trains only beside a policy update on the same task.

Groups never cross data-parallel ranks: the trainer generates all samples of a task on one rank, so
this computation is local and needs no communication.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from fastrehearse.data import Episode
from fastrehearse.kernels.roles import Role

RL_ROLES = (Role.ACT, Role.REHEARSE)


@dataclass
class AdvantageConfig:
    std_normalize: bool = False         # divide by the group's std + eps (off, as in the paper's code and Dr. GRPO)
    leave_one_out: bool = False         # the RLOO baseline: the mean of the group's other members
    eps: float = 1e-6
    gate_rehearse_on_act: bool = False   # REHEARSE advantage 0 in groups where ACT has no signal


@dataclass
class AdvantageStats:
    """What the trainer logs about one step's advantages."""
    num_groups: int = 0
    # Groups whose rewards for a role (over the episodes where the role acted) are all equal carry
    # no signal for that role; mean_reward / mean_abs_adv are over those episodes too.
    zero_std_frac: dict[str, float] = field(default_factory=dict)
    mean_reward: dict[str, float] = field(default_factory=dict)
    mean_abs_adv: dict[str, float] = field(default_factory=dict)
    # Share of the baseline groups of a role (task groups, or (task, stratum) groups for a
    # stratified ACT) that give every member advantage 0: equal rewards, a single member, or no
    # member (the role never acted in the group: every episode's call was malformed, say).
    zero_signal_frac: dict[str, float] = field(default_factory=dict)
    # Task groups where some ACT stratum has unequal rewards (what the REHEARSE gate reads).
    act_signal_groups: int = 0


def group_advantages(rewards: torch.Tensor, *, std_normalize: bool = False,
                     leave_one_out: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of the episodes of ONE group for ONE role. rewards: [G] -> [G] float64."""
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    g = r.numel()
    if not torch.isfinite(r).all():
        raise ValueError(f"rewards contain a non-finite value: {r.tolist()}")
    if g <= 1:
        return torch.zeros_like(r)
    if leave_one_out:
        baseline = (r.sum() - r) / (g - 1)
    else:
        baseline = r.mean().expand(g)
    adv = r - baseline
    if std_normalize:
        adv = adv / (r.std() + eps)
    return adv


def _role_reward(ep: Episode, role: Role) -> float:
    # role_rewards may be keyed by int or Role (both hash equal) or, after JSON, by str.
    for key in (int(role), str(int(role))):
        if key in ep.role_rewards:
            return float(ep.role_rewards[key])
    return float(ep.reward)


def compute_advantages(episodes: Sequence[Episode], config: AdvantageConfig | None = None,
                       roles: tuple[Role, ...] = RL_ROLES) -> tuple[list[list[float]], AdvantageStats]:
    """The advantage of every token of every episode (one list per episode, aligned with its
    input_ids) and the step's statistics. The episodes are read, not changed."""
    cfg = config or AdvantageConfig()
    groups: dict[str, list[int]] = defaultdict(list)
    for i, ep in enumerate(episodes):
        groups[ep.task_id].append(i)

    per_token = [torch.zeros(len(ep), dtype=torch.float64) for ep in episodes]
    role_t = [torch.as_tensor(ep.roles, dtype=torch.int64) for ep in episodes]
    stats = AdvantageStats(num_groups=len(groups))
    zero_std = defaultdict(int)
    abs_adv = defaultdict(list)
    all_r = defaultdict(list)

    n_groups = defaultdict(int)      # baseline groups per role (task groups; ACT: its strata)
    zero_signal = defaultdict(int)
    if cfg.gate_rehearse_on_act and Role.REHEARSE in roles and Role.ACT not in roles[:roles.index(Role.REHEARSE)]:
        raise ValueError("gate_rehearse_on_act needs ACT before REHEARSE in `roles` (the gate reads "
                         f"ACT's signal first), got {[r.name for r in roles]}")
    for idx in groups.values():
        act_signal = False     # some ACT stratum of this group has unequal rewards
        for role in roles:
            masks = {i: role_t[i] == int(role) for i in idx}
            members = [i for i in idx if bool(masks[i].any())]   # g_r
            if not members:              # the role never acted in this group: no signal either
                n_groups[role.name] += 1
                zero_signal[role.name] += 1
                continue
            gate = cfg.gate_rehearse_on_act and role == Role.REHEARSE and not act_signal
            strata = [members]
            if role == Role.ACT and any("stratum" in episodes[i].metadata for i in members):
                keys = sorted({str(episodes[i].metadata.get("stratum")) for i in members})
                strata = [[i for i in members if str(episodes[i].metadata.get("stratum")) == k] for k in keys]
            for sub in strata:
                n_groups[role.name] += 1
                rewards = torch.tensor([_role_reward(episodes[i], role) for i in sub], dtype=torch.float64)
                adv = group_advantages(rewards, std_normalize=cfg.std_normalize,
                                       leave_one_out=cfg.leave_one_out, eps=cfg.eps)
                same = bool((rewards == rewards[0]).all())
                if role == Role.ACT and not same:
                    act_signal = True
                if gate:
                    adv = torch.zeros_like(adv)
                zero_std[role.name] += int(len(sub) > 1 and same)
                zero_signal[role.name] += int(same or gate)      # a single member is "all equal" too
                all_r[role.name] += rewards.tolist()
                for a, i in zip(adv.tolist(), sub):
                    per_token[i][masks[i]] = a
                    abs_adv[role.name].append(abs(a))
        stats.act_signal_groups += int(act_signal)

    for role in roles:
        n = max(n_groups[role.name], 1)
        stats.zero_std_frac[role.name] = zero_std[role.name] / n
        stats.zero_signal_frac[role.name] = zero_signal[role.name] / n
        stats.mean_reward[role.name] = sum(all_r[role.name]) / max(len(all_r[role.name]), 1)
        stats.mean_abs_adv[role.name] = sum(abs_adv[role.name]) / max(len(abs_adv[role.name]), 1)
    return [a.tolist() for a in per_token], stats


def with_advantages(episodes: Sequence[Episode], advantages: Sequence[Sequence[float]]) -> list[Episode]:
    """New episodes carrying `advantages` (compute_advantages' first result), what packing reads."""
    if len(episodes) != len(advantages):
        raise ValueError(f"{len(advantages)} advantage lists for {len(episodes)} episodes")
    return [replace(ep, advantages=list(a)) for ep, a in zip(episodes, advantages)]
