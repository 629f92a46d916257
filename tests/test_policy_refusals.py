"""The plan (config.json alone) and the engine (the loaded model) refuse the same policies
with the same words: ``plan`` must never say a policy fits that ``generate`` then refuses,
nor refuse one it runs (gpt-oss with --kv-bits was planned, then refused at load; KIVI
keys with a group wider than head_dim were refused by the plan, then run)."""

from __future__ import annotations

import pytest

from mlxkv.caches import plan_policy
from mlxkv.caches.build import cache_head_dims
from mlxkv.memory.estimate import check_policy
from mlxkv.memory.probe import probe
from mlxkv.policy import KVPolicy, PolicyError
from tests.tiny_models import FAMILIES, build_family

POLICIES = [
    KVPolicy(window=40),
    KVPolicy(window=40, sinks=4),
    KVPolicy(bits=4, group_size=32),
    KVPolicy(bits=4, group_size=128, value_group_size=32),  # KIVI key groups run along tokens
    KVPolicy(bits=4, group_size=32, value_group_size=128),
    KVPolicy(key_bits=4, group_size=128, key_scheme="plain"),
    KVPolicy(value_bits=8, value_group_size=128),
]


def _refusal(check) -> str | None:
    try:
        check()
    except PolicyError as e:
        return str(e)
    return None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plan_and_engine_refuse_the_same_policies(family):
    model = build_family(family)
    layout = probe(FAMILIES[family])
    dims = cache_head_dims(model)
    for policy in POLICIES:
        engine = _refusal(lambda p=policy: plan_policy(model, p, head_dims=dims))
        if engine and "cannot re-position attention sinks" in engine:
            continue  # the rope module decides it: only the loaded model can tell
        plan = _refusal(lambda p=policy: check_policy(layout, p))
        assert plan == engine, policy
