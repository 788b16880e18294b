"""Shared-prompt packing for the language trainer's forward passes: a GRPO group's samples
share their prompt, so the prompt is run once per group and every sample's answer attends to
it (as in Prefix Grouper, arXiv 2506.05433). A group becomes one packed row,

    prompt[:-1] | prompt[-1] answer_1 | prompt[-1] answer_2 | ... | padding

with each answer's positions continuing the prompt's and a block mask: the prompt is causal
within itself, an answer sees the prompt and its own earlier tokens. Each answer segment starts
with the prompt's last token, whose hidden state predicts the answer's first token. Values and
gradients equal the unpacked rows'; the prompt's tokens are computed once instead of once per
sample, while attention grows with the packed row's length (it pays for short answers to long
prompts: ``actor.shared_prefix``).

Pure tensor code: the packing, the block mask and the way back to ``[rows, width]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """Packed rows and the way back: ``values[source]`` lands at ``[rows, columns][target]``."""

    input_ids: torch.Tensor  # [packs, T]
    position_ids: torch.Tensor  # [packs, T]
    attention: torch.Tensor  # [packs, 1, T, T] bool: True where a query attends to a key
    wanted: torch.Tensor  # [packs, T] bool
    source: tuple[torch.Tensor, torch.Tensor]  # (pack, position) of each unpacked element
    target: tuple[torch.Tensor, torch.Tensor]  # (row, column) it came from

    def unpack(self, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """``[packs, T]`` values back to ``[rows, width]`` (0 where a row's column was not
        packed as an answer token: the shared prompt); differentiable."""
        out = values.new_zeros(shape)
        return out.index_put(self.target, values[self.source])


def _shared_length(ids: torch.Tensor, rows: list[int], first: list[int]) -> int:
    """How many leading columns ``rows`` share, up to the first wanted column of any of them."""
    p = min(first[r] for r in rows)
    base = ids[rows[0], :p]
    for r in rows[1:]:
        differs = (ids[r, :p] != base).nonzero()
        if len(differs):
            p = int(differs[0])
    return p


def pack_shared_prefixes(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    wanted: torch.Tensor,
    group_ids: torch.Tensor,
) -> PackedRows:
    """Pack right-padded rows ``[rows, width]`` by group: the leading tokens a group's rows
    share (up to the first ``wanted`` position of any of them) are packed once. A row alone,
    or a group sharing fewer than two tokens, is packed as it is."""
    lengths = attention_mask.sum(1).tolist()
    has_wanted = wanted.any(1)
    first = torch.where(has_wanted, wanted.long().argmax(1), attention_mask.sum(1)).tolist()
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(group_ids.tolist()):
        groups.setdefault(g, []).append(row)
    packs = []  # (shared prefix length p, rows): answers start at column p - 1
    for rows in groups.values():
        p = _shared_length(input_ids, rows, first) if len(rows) > 1 else 0
        packs += [(p, rows)] if p >= 2 else [(1, [r]) for r in rows]
    sizes = [p - 1 + sum(lengths[r] - p + 1 for r in rows) for p, rows in packs]
    width, device = max(sizes), input_ids.device
    ids = torch.zeros(len(packs), width, dtype=input_ids.dtype, device=device)
    positions = torch.zeros(len(packs), width, dtype=torch.long, device=device)
    segment = torch.full((len(packs), width), -1, dtype=torch.long, device=device)  # -1: padding
    packed_wanted = torch.zeros(len(packs), width, dtype=torch.bool, device=device)
    source, target = ([], []), ([], [])
    for k, (p, rows) in enumerate(packs):
        ids[k, : p - 1] = input_ids[rows[0], : p - 1]
        positions[k, : p - 1] = torch.arange(p - 1, device=device)
        segment[k, : p - 1] = 0
        at = p - 1
        for s, r in enumerate(rows, start=1):
            n = lengths[r] - p + 1
            columns = torch.arange(p - 1, lengths[r], device=device)
            ids[k, at : at + n] = input_ids[r, columns]
            positions[k, at : at + n] = columns
            segment[k, at : at + n] = s
            packed_wanted[k, at : at + n] = wanted[r, columns]
            source[0].append(torch.full((n,), k, device=device))
            source[1].append(torch.arange(at, at + n, device=device))
            target[0].append(torch.full((n,), r, device=device))
            target[1].append(columns)
            at += n
    return PackedRows(
        input_ids=ids,
        position_ids=positions,
        attention=block_attention(segment),
        wanted=packed_wanted,
        source=(torch.cat(source[0]), torch.cat(source[1])),
        target=(torch.cat(target[0]), torch.cat(target[1])),
    )


def block_attention(segment: torch.Tensor) -> torch.Tensor:
    """``[packs, 1, T, T]``: a query attends to an earlier (or the same) key of the shared
    prefix (segment 0) or of its own segment; padding (-1) attends to itself alone, so that no
    row of the softmax is empty."""
    q, k = segment[:, :, None], segment[:, None, :]
    t = torch.arange(segment.shape[1], device=segment.device)
    causal = t[None, :, None] >= t[None, None, :]
    valid = (q >= 0) & (k >= 0)
    attend = causal & valid & ((k == 0) | (k == q))
    return (attend | torch.eye(len(t), dtype=torch.bool, device=t.device))[:, None]


def attention_mask_for(model, attend: torch.Tensor) -> torch.Tensor:
    """The block mask as ``model``'s attention reads a custom 4-D mask: booleans for sdpa (and
    flex/other mask functions that take them), an additive float mask for eager attention."""
    inner = model
    while not hasattr(inner, "config"):
        inner = getattr(inner, "module", None) or inner.model
    if getattr(inner.config, "_attn_implementation", "sdpa") != "eager":
        return attend
    dtype = getattr(inner, "dtype", torch.float32)
    blank = torch.zeros(attend.shape, dtype=dtype, device=attend.device)
    return blank.masked_fill(~attend, torch.finfo(dtype).min)


def shared_prefix_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    group_ids: torch.Tensor,
    temperature: float,
    wanted: torch.Tensor,
) -> torch.Tensor:
    """``token_logprobs`` of the ``wanted`` positions (0 elsewhere) with each group's shared
    prompt computed once (the module docstring)."""
    from tidal.algorithms.tokens import token_logprobs

    packed = pack_shared_prefixes(input_ids, attention_mask, wanted, group_ids)
    values = token_logprobs(
        model,
        packed.input_ids,
        attention_mask_for(model, packed.attention),
        temperature,
        wanted=packed.wanted,
        position_ids=packed.position_ids,
    )
    return packed.unpack(values, tuple(input_ids.shape))


def group_micro_batches(
    attention_mask: torch.Tensor, group_ids: torch.Tensor, rows: torch.Tensor, budget: int
) -> list[tuple[torch.Tensor, int]]:
    """``rows`` in micro-batches of whole groups (a group's prompt packs once), consecutive
    groups while their unpacked tokens fit ``budget`` (a group larger than it goes alone), each
    with the width of its longest row."""
    lengths = attention_mask[rows].sum(1).tolist()
    groups = group_ids[rows].tolist()
    batches, current, tokens = [], [], 0
    for k, n in enumerate(lengths):
        starts_group = k == 0 or groups[k] != groups[k - 1]
        if starts_group and current and tokens + _group_tokens(lengths, groups, k) > budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(k)
        tokens += n
    if current:
        batches.append(current)
    return [(rows[idx], max(lengths[k] for k in idx)) for idx in batches]


def _group_tokens(lengths: list[int], groups: list[int], start: int) -> int:
    end = start
    while end < len(groups) and groups[end] == groups[start]:
        end += 1
    return sum(lengths[start:end])
