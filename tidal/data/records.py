"""The embodied records: what the env sends the rollout, what comes back, what the actor trains on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class EnvOutput:
    """One chunk step of a batch of envs (``B`` envs, ``C`` actions per chunk).

    ``obs`` is what the policy sees next (after any reset). For envs whose episode ended in
    this chunk, ``final_obs`` holds the observation the episode ended on (else a copy of
    ``obs``) — the rollout bootstraps truncated episodes from it. ``rewards``,
    ``terminations``, ``truncations`` and ``dones`` are ``[B, C]``; ``dones`` is
    ``terminations | truncations``.
    """

    obs: torch.Tensor
    final_obs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    terminations: torch.Tensor | None = None
    truncations: torch.Tensor | None = None
    dones: torch.Tensor | None = None
    # the value of final_obs is needed for these envs ([B] bool): set by the env worker
    needs_bootstrap: torch.Tensor | None = None


@dataclass(kw_only=True)
class ChunkActions:
    """The rollout's answer for a batch of envs: an action chunk per env and what the actor
    needs later. ``logprobs`` are per action dimension ``[B, C, A]``; ``values`` ``[B]``;
    ``final_values`` ``[B]`` the value of ``final_obs`` where the env asked for a bootstrap.

    When the rollout keeps the policy's half of the record (``RolloutWorker.generate`` with
    ``policy_record``) an answer carries only ``env_actions`` and ``final_values``: the rest
    comes once per epoch, batch-first, as a ``PolicyRecord``."""

    env_actions: torch.Tensor  # as the env takes them, [B, C, ...]
    actions: torch.Tensor | None = None  # in the policy's own space (what the actor re-evaluates)
    logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    final_values: torch.Tensor | None = None
    forward_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    version: torch.Tensor | None = None  # [B] policy version that chose the actions


@dataclass(kw_only=True)
class PolicyRecord:
    """The policy's half of an epoch's ``Trajectory``, batch-first, kept by the rollout and
    sent once: ``forward_inputs`` ``{name: [B, T, ...]}``, ``actions`` ``[B, T, C, ...]``,
    ``logprobs`` ``[B, T, C, A]``, ``values`` ``[B, T + 1]`` (the last column bootstraps),
    ``versions`` ``[B, T]``, ``bootstrap_inputs`` ``{name: [B, ...]}`` (the forward inputs of
    the bootstrap step)."""

    forward_inputs: dict[str, torch.Tensor]
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor | None
    versions: torch.Tensor
    bootstrap_inputs: dict[str, torch.Tensor]


@dataclass(kw_only=True)
class Trajectory:
    """One rollout epoch of ``B`` envs over ``T`` chunk steps, batch-first.

    ``forward_inputs`` ``{name: [B, T, ...]}`` re-evaluate the policy; ``actions``
    ``[B, T, C, ...]``; ``prev_logprobs`` ``[B, T, C, A]``; ``prev_values`` ``[B, T + 1]``
    (the last column bootstraps); ``rewards`` ``[B, T, C]``; ``terminations``,
    ``truncations`` and ``dones`` ``[B, T + 1, C]`` where column ``t + 1`` ends step ``t`` and
    column 0 is the previous epoch's last; ``raw_obs`` ``[B, T, ...]`` for the observation
    normaliser; ``versions`` ``[B, T]``; ``valid`` ``[B, T]``: False where an env's samples are
    masked (it returned a non-finite value at or after that step in this epoch);
    ``bootstrap_inputs`` ``{name: [B, ...]}``: the forward inputs of the step whose value
    bootstraps the last (a newer critic can value the whole epoch again).
    """

    forward_inputs: dict[str, torch.Tensor]
    actions: torch.Tensor
    prev_logprobs: torch.Tensor
    prev_values: torch.Tensor | None
    rewards: torch.Tensor
    terminations: torch.Tensor
    truncations: torch.Tensor
    dones: torch.Tensor
    raw_obs: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    bootstrap_inputs: dict[str, torch.Tensor] | None = None

    def samples(self) -> dict[str, torch.Tensor]:
        """The per-step tensors a trainer re-evaluates, flat and time-major (``[T * B, ...]``):
        ``in.<name>`` forward inputs, ``actions``, ``old_logprobs``, ``versions``."""
        return {
            **{f"in.{k}": flat_time_major(v) for k, v in self.forward_inputs.items()},
            "actions": flat_time_major(self.actions),
            "old_logprobs": flat_time_major(self.prev_logprobs),
            "versions": flat_time_major(self.versions),
        }


def flat_time_major(x: torch.Tensor) -> torch.Tensor:
    """Batch-first ``[B, T, ...]`` → time-major and flat, ``[T * B, ...]``."""
    return flatten_steps(x.transpose(0, 1))


def flatten_steps(x: torch.Tensor) -> torch.Tensor:
    """``[T, B, ...]`` → ``[T * B, ...]``."""
    return x.reshape(-1, *x.shape[2:])


# ----------------------------------------------------------------------------- language records


@dataclass
class TokenSequence:
    """One sample of a language episode, built turn by turn: context tokens (the prompt, an
    environment's feedback) are not trained on; generated tokens carry their behaviour
    log-prob and the weight version that sampled them."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add_context(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.loss_mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)

    def add_generated(self, tokens: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not len(tokens) == len(logprobs) == len(versions):
            raise ValueError(
                f"generated tokens, log-probs and versions differ in length: "
                f"{len(tokens)}, {len(logprobs)}, {len(versions)}"
            )
        self.tokens += tokens
        self.loss_mask += [1] * len(tokens)
        self.logprobs += logprobs
        self.versions += versions


_LLM_FILLS = {"attention_mask": 0, "loss_mask": 0, "logprobs": 0.0, "versions": -1}


@dataclass(kw_only=True)
class LLMBatch:
    """Language samples padded on the right to one width ``L``: ``input_ids``,
    ``attention_mask`` and ``loss_mask`` (1 on generated tokens) ``[n, L]``; behaviour
    ``logprobs`` (0 elsewhere) and ``versions`` (-1 elsewhere) ``[n, L]``; ``rewards`` ``[n]``.
    What a workflow returns for one episode, and what the trainer trains on."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    rewards: torch.Tensor
    # ``[n]``: the group (one workflow call: the samples of one prompt) of each row. An agent
    # whose episodes give one row per call gives a group more rows than ``group_size``, so group
    # estimators read these ids rather than contiguous blocks.
    group_ids: torch.Tensor | None = None

    def __post_init__(self):
        n = self.input_ids.shape[0]
        if self.group_ids is None:  # a workflow call's batch is one group unless it says
            self.group_ids = torch.zeros(n, dtype=torch.long, device=self.input_ids.device)
        if tuple(self.group_ids.shape) != (n,):
            raise ValueError(
                f"LLMBatch.group_ids: expected one id per row, shape ({n},), "
                f"got {tuple(self.group_ids.shape)}"
            )

    @classmethod
    def from_sequences(
        cls, seqs: list[TokenSequence], rewards: list[float], pad_id: int = 0
    ) -> LLMBatch:
        """One workflow call's samples: one group."""
        width = max(len(s.tokens) for s in seqs)

        def pad(values, fill, dtype):
            return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=dtype)

        return cls(
            input_ids=pad([s.tokens for s in seqs], pad_id, torch.long),
            attention_mask=pad([[1] * len(s.tokens) for s in seqs], 0, torch.bool),
            loss_mask=pad([s.loss_mask for s in seqs], 0, torch.bool),
            logprobs=pad([s.logprobs for s in seqs], 0.0, torch.float32),
            versions=pad([s.versions for s in seqs], -1, torch.long),
            rewards=torch.tensor(rewards, dtype=torch.float32),
        )

    @classmethod
    def concat(cls, batches: list[LLMBatch], pad_id: int = 0) -> LLMBatch:
        """Rows of every batch, the token dimension padded to the widest."""
        width = max(b.width for b in batches)
        fills = {"input_ids": pad_id, **_LLM_FILLS}

        def column(name):
            parts = []
            for b in batches:
                x = getattr(b, name)
                if name in fills and x.shape[1] < width:
                    x = torch.cat(
                        [
                            x,
                            torch.full(
                                (x.shape[0], width - x.shape[1]), fills[name], dtype=x.dtype
                            ),
                        ],
                        1,
                    )
                parts.append(x)
            return torch.cat(parts, 0)

        groups, offset = [], 0
        for b in batches:  # each batch's groups stay apart from the others'
            groups.append(b.group_ids + offset)
            offset += int(b.group_ids.max()) + 1 if len(b) else 0
        return cls(
            **{name: column(name) for name in (*fills, "rewards")}, group_ids=torch.cat(groups)
        )

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]
