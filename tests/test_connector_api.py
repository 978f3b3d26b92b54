"""The connector class against the installed vLLM's connector API (no engine needed)."""

import inspect

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from kvtier.vllm import ConnectorConfig, KVTierConnector, KVTierStats  # noqa: E402


def test_every_abstract_hook_is_implemented_with_vllms_signature():
    assert not KVTierConnector.__abstractmethods__
    for name in KVConnectorBase_V1.__abstractmethods__ | {"get_finished", "request_finished", "register_kv_caches"}:
        ours = list(inspect.signature(getattr(KVTierConnector, name)).parameters.values())
        theirs = list(inspect.signature(getattr(KVConnectorBase_V1, name)).parameters.values())
        # vLLM passes some arguments by position, some by name: names, order and kinds must match
        assert [(p.name, p.kind) for p in ours[: len(theirs)]] == [(p.name, p.kind) for p in theirs], name
        assert all(p.default is not p.empty or p.kind == p.VAR_KEYWORD for p in ours[len(theirs) :]), name
    assert "kv_cache_config" in inspect.signature(KVTierConnector.__init__).parameters


def test_stats_round_trip_through_vllms_hooks():
    worker = KVTierStats(data={"loaded_blocks": 3, "stored_blocks": 1})
    scheduler = KVTierStats(data={"hit_tokens": 384, "loaded_blocks": 2})
    merged = worker.aggregate(scheduler)
    assert merged.reduce() == {"loaded_blocks": 5, "stored_blocks": 1, "hit_tokens": 384}
    rebuilt = KVTierConnector.build_kv_connector_stats(merged.to_dict())  # what crosses to the frontend
    assert rebuilt is not None and rebuilt.reduce() == merged.reduce()
    assert KVTierConnector.build_kv_connector_stats(None) is None
    assert KVTierStats(data={"lookups": 0}).is_empty()


def test_unknown_extra_config_keys_are_ignored():
    config = ConnectorConfig.from_extra({"address": "unix:///x.sock", "no_such_key": 1, "timeout_s": 0.5})
    assert (config.address, config.timeout_s) == ("unix:///x.sock", 0.5)
