"""Weighted adapter mixes: several adapters with weights acting as one, in one device slot.

A mix of adapters i with weights w_i computes Σ w_i·(B_i·A_i)·scaling_i: PEFT's add_weighted_adapter(...,
combination_type="cat"), whose A and B are the members' stacked along the rank (weight and scaling folded into
one side). So a mix is just another slot's constants: its rank is the sum of its members' ranks, padded to
--max-lora-rank like any adapter's, and the compiled step runs it as it runs one adapter, beside single adapters,
other mixes and the base model. One adapter with a weight is a scaled adapter.

A mix travels through the engine under one name, its canonical form `pirate*0.7+robot*0.3`: '*' and '+' are not
allowed in adapter names (adapters.check_adapter_name), so a mix can never be taken for an adapter, and the same
members with the same weights always name the same slot. Members keep the order given (it is PEFT's cat order);
weights are written exactly (the shortest text that reads back as the same float).
"""
from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import AdapterMixError
from .adapters import LoRAAdapter, check_adapter_name

MAX_MIX_ADAPTERS = 8       # members of one mix
MAX_MIX_WEIGHT = 100.0     # |weight| of a member
_JOIN, _TIMES = "+", "*"


@dataclass(frozen=True)
class AdapterMix:
    members: tuple[tuple[str, float], ...]  # (adapter name, weight), in the order given, names distinct

    @property
    def name(self) -> str:
        """The canonical name; one member at weight 1 is that adapter itself."""
        if len(self.members) == 1 and self.members[0][1] == 1.0:
            return self.members[0][0]
        return _JOIN.join(f"{name}{_TIMES}{weight!r}" for name, weight in self.members)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.members)

    @staticmethod
    def parse(name: str | None) -> AdapterMix | None:
        """The mix `name` names; None for a plain adapter name (or no adapter)."""
        if not name or _TIMES not in name:
            return None
        members = []
        for part in name.split(_JOIN):
            member, _, weight = part.rpartition(_TIMES)
            members.append((member, float(weight)))
        return AdapterMix(tuple(members))


def mix_problems(members: Sequence[tuple[str, float]]) -> list[tuple[int | None, str]]:
    """What is wrong with a requested mix: (member index or None for the whole list, message) pairs, in our
    words. Checks the member count first (a longer list is not read), then names against the one rule, weights and
    duplicates (not ranks: check_members)."""
    if len(members) > MAX_MIX_ADAPTERS:
        return [(None, f"at most {MAX_MIX_ADAPTERS} adapters in one mix, got {len(members)}")]
    problems: list[tuple[int | None, str]] = []
    seen: set[str] = set()
    for i, (name, weight) in enumerate(members):
        try:
            check_adapter_name(name)
        except Exception as e:  # noqa: BLE001 - AdapterNameError: its message is the rule
            problems.append((i, str(e)))
            continue
        if name in seen:
            problems.append((i, f"adapter {name!r} is named twice; give each adapter once, with the sum of its "
                                "weights"))
        seen.add(name)
        if not (math.isfinite(weight) and abs(weight) <= MAX_MIX_WEIGHT):
            problems.append((i, f"the weight of {name!r} must be a finite number in [-{MAX_MIX_WEIGHT:g}, "
                                f"{MAX_MIX_WEIGHT:g}], got {weight!r}"))
    return problems


def make_mix(members: list[tuple[str, float]]) -> AdapterMix | None:
    """The mix of these (checked: mix_problems) members; zero weights dropped (that adapter adds nothing, as in
    llama.cpp's per-request `lora`); None when nothing is left (the base model)."""
    kept = tuple((name, float(weight)) for name, weight in members if weight != 0)
    return AdapterMix(kept) if kept else None


def check_members(members: list[LoRAAdapter], max_rank: int) -> None:
    """Raise AdapterMixError where these adapters (their facts; weights not needed) cannot be mixed: activated or
    DoRA adapters (what they compute is not a sum of B·A), or ranks that add up past max_rank."""
    for adapter in members:
        if adapter.invocation_tokens is not None:
            raise AdapterMixError(f"adapter {adapter.name!r} is an activated LoRA (alora_invocation_tokens): it "
                                  "acts from its own position in the prompt and cannot be mixed; request it alone")
        if adapter.use_dora:
            raise AdapterMixError(f"adapter {adapter.name!r} is a DoRA adapter (use_dora): its weight-norm rescale "
                                  "does not add up with other adapters; request it alone")
    total = sum(adapter.rank for adapter in members)
    if total > max_rank:
        ranks = " + ".join(f"{a.name} {a.rank}" for a in members)
        raise AdapterMixError(f"the ranks of a mix add up: {ranks} = {total}, over this server's --max-lora-rank "
                              f"{max_rank}; mix fewer or lower-rank adapters, or raise --max-lora-rank")


def compose(mix: AdapterMix, members: list[LoRAAdapter], max_rank: int) -> LoRAAdapter:
    """The mix as one adapter: per module, A stacked along the rank and B (scaling folded in already) times each
    member's weight beside it; a member without that module adds nothing there. Host memory, no device op."""
    check_members(members, max_rank)
    num_layers = len(members[0].weights)
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for layer in range(num_layers):
        modules = dict.fromkeys(m for adapter in members for m in adapter.weights[layer])
        mixed = {}
        for module in modules:
            parts = [(adapter.weights[layer][module], weight)
                     for adapter, (_, weight) in zip(members, mix.members) if module in adapter.weights[layer]]
            a = torch.cat([a for (a, _), _ in parts], dim=0)
            b = torch.cat([b * weight for (_, b), weight in parts], dim=1)
            mixed[module] = (a, b)
        weights.append(mixed)
    targets = tuple(dict.fromkeys(t for adapter in members for t in adapter.target_modules))
    return LoRAAdapter(mix.name, members[0].path, sum(a.rank for a in members), float(sum(a.rank for a in members)),
                       False, targets, weights, mix_digest(mix, members))


def mix_digest(mix: AdapterMix, members: list[LoRAAdapter]) -> bytes:
    """What the prefix cache keys the mix's KV by: each member's name, weights digest and weight, in order. A
    changed weight or a reloaded member is another key, so no stale block is ever found."""
    h = hashlib.sha256(b"mix")
    for adapter, (_, weight) in zip(members, mix.members):
        h.update(adapter.name.encode() + b"\0" + adapter.digest + struct.pack("<d", weight))
    return h.digest()
