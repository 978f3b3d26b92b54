"""The connector class against the installed vLLM's connector API (no engine needed)."""

import inspect
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from kvtier.vllm import ConnectorConfig, KVTierConnector, KVTierMetadata, KVTierStats, model_identity, namespace_spec  # noqa: E402


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


def engine_config(tmp_path, **changes):
    """What namespace_spec reads of vLLM's config (vLLM's own KV cache spec classes and HF config)."""
    import torch
    from transformers import LlamaConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model_dir = tmp_path / "model"
    if not model_dir.exists():
        model_dir.mkdir()
        (model_dir / "model.safetensors").write_bytes(b"weights")
    kv_spec = changes.pop("kv_spec", None) or FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    model = SimpleNamespace(
        model=str(model_dir),
        revision=changes.pop("revision", None),
        quantization=changes.pop("quantization", None),
        dtype=torch.bfloat16,
        hf_config=LlamaConfig(num_hidden_layers=2, **changes.pop("loaded_config", {})),
        hf_overrides=changes.pop("hf_overrides", {}),
        hf_config_path=changes.pop("hf_config_path", None),
        model_weights=changes.pop("model_weights", ""),
    )
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, decode_context_parallel_size=1)
    for name, value in changes.pop("parallel", {}).items():
        setattr(parallel, name, value)
    vllm_config = SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(block_size=16, prefix_caching_hash_algo="sha256", **changes.pop("cache", {})),
        parallel_config=parallel,
        load_config=SimpleNamespace(
            load_format=changes.pop("load_format", "auto"), model_loader_extra_config=changes.pop("loader_extra", {})
        ),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=changes.pop("extra_config", {})),
        device_config=SimpleNamespace(device_type=changes.pop("device", "cpu")),
    )
    groups = [KVCacheGroupSpec(layer_names=["layer.0", "layer.1"], kv_cache_spec=kv_spec)]
    kv_cache_config = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups, **changes)
    return vllm_config, kv_cache_config


def spec_of(tmp_path, **changes):
    vllm_config, kv_cache_config = engine_config(tmp_path, **changes)
    return namespace_spec(vllm_config, kv_cache_config, ConnectorConfig(), model_identity(vllm_config))


def digest(tmp_path, **changes) -> str:
    from kvtierd.namespace import namespace_digest

    return namespace_digest(spec_of(tmp_path, **changes))


def test_what_changes_a_models_kv_values_changes_its_namespace(tmp_path):
    """The same model path with other weights (another model copied there), a quantized model or
    overridden rope scaling compute other KV for the same tokens: each is a namespace of its own.
    What model code changes in the loaded HF config (in one engine's process, not another's) does
    not count."""
    base = digest(tmp_path)
    assert digest(tmp_path) == base  # (the same engine configured again: the same namespace)
    assert digest(tmp_path, loaded_config={"projector_hidden_act": "gelu"}) == base
    assert digest(tmp_path, quantization="fp8") != base
    assert digest(tmp_path, hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}) != base
    assert digest(tmp_path, hf_config_path="org/other-config") != base  # (a hub config: by its name)
    assert digest(tmp_path, load_format="safetensors") == base  # (the same weights, read another way)
    assert digest(tmp_path, load_format="dummy") != base  # random weights
    assert digest(tmp_path, model_weights="s3://bucket/other") != base  # weights pulled apart from the configs
    theta = [lambda config: setattr(config, "rope_theta", 1e4), lambda config: setattr(config, "rope_theta", 5e5)]
    assert digest(tmp_path, hf_overrides=theta[0]) != digest(tmp_path, hf_overrides=theta[1])
    weights = tmp_path / "model" / "model.safetensors"
    os.utime(weights, ns=(1, 1))  # the same files copied anew: the same namespace
    assert digest(tmp_path) == base
    weights.write_bytes(b"other-w")  # other weights of the same size: another
    assert digest(tmp_path) != base


def test_tensorizer_weights_are_part_of_the_models_identity(tmp_path):
    """--load-format tensorizer reads the weights from its tensorizer_uri (or _dir); --model names only
    the config: other weights are another namespace, a local file's by its contents too (other weights
    written over the same path), and nothing else of the loader's config (S3 credentials) is kept."""
    from vllm.model_executor.model_loader.tensorizer import TensorizerConfig

    def tensorized(uri, **more):
        return digest(tmp_path, load_format="tensorizer", loader_extra={"tensorizer_config": {"tensorizer_uri": uri, **more}})

    local = tmp_path / "a.tensors"
    local.write_bytes(b"weights-a")
    base = digest(tmp_path)
    assert len({base, tensorized("s3://bucket/a.tensors"), tensorized("s3://bucket/b.tensors")}) == 3
    before = tensorized(str(local))
    assert before == tensorized(str(local)) and before != base
    local.write_bytes(b"weights-b")
    assert tensorized(str(local)) != before
    assert tensorized("s3://bucket/a.tensors", s3_secret_access_key="x") == tensorized("s3://bucket/a.tensors")
    config = TensorizerConfig(tensorizer_uri="s3://bucket/a.tensors")
    assert digest(tmp_path, load_format="tensorizer", loader_extra=config) == tensorized("s3://bucket/a.tensors")
    assert "secret" not in str(spec_of(tmp_path, load_format="tensorizer", loader_extra=config).extra)


def test_each_kv_cache_encoding_is_a_namespace_of_its_own(tmp_path):
    """vLLM keeps every fp8 KV format in uint8 (the same torch dtype and block size): e4m3 bytes read
    as e5m2 are other values, so each --kv-cache-dtype, and each set of layers left unquantized, is a
    namespace of its own; the model's own dtype ("auto") keeps the namespace it had."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    fp8 = {"kv_spec": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.uint8)}
    formats = [digest(tmp_path, cache={"cache_dtype": name}, **fp8) for name in ("fp8", "fp8_e4m3", "fp8_e5m2")]
    assert len(set(formats)) == 3
    skipping = digest(tmp_path, cache={"cache_dtype": "fp8", "kv_cache_dtype_skip_layers": ["0", "2"]}, **fp8)
    assert skipping != formats[0]
    assert digest(tmp_path, cache={"cache_dtype": "fp8", "kv_cache_dtype_skip_layers": ["2", "0"]}, **fp8) == skipping
    assert digest(tmp_path, cache={"cache_dtype": "auto", "kv_cache_dtype_skip_layers": []}) == digest(tmp_path)


def test_a_tensor_parallel_engines_ranks_share_one_namespace_whose_keys_carry_the_rank(tmp_path):
    """Every rank registers the scheduler's spec (tp_rank 0; a worker adds only its pipeline stage);
    the keys are vLLM's hashes followed by two bytes of rank, which the spec's hash_bytes counts.
    A TP=1 engine's spec is what it was before ranks had keys."""
    one = spec_of(tmp_path)
    tp = spec_of(tmp_path, parallel={"tensor_parallel_size": 4})
    assert (one.hash_bytes, one.tp_size, one.tp_rank) == (32, 1, 0)
    assert (tp.hash_bytes, tp.tp_size, tp.tp_rank) == (34, 4, 0)


@pytest.mark.parametrize(
    "device,block_size,setting,layout",
    [
        ("cuda", 16, None, "BLHNC"),
        ("cuda", 64, None, "BLHNC"),
        ("cuda", 128, None, None),  # FlashInfer / FlashMLA would split it into kernel blocks: vLLM would not start
        ("cuda", 128, True, "BLHNC"),
        ("cuda", 16, False, None),
        ("cpu", 16, None, None),
    ],
)
def test_gpu_engines_ask_for_a_block_outermost_layout_where_no_kernel_splits_blocks(device, block_size, setting, layout):
    extra = {} if setting is None else {"block_outermost_layout": setting}
    vllm_config = SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        cache_config=SimpleNamespace(block_size=block_size),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
    )
    assert KVTierConnector.get_required_kvcache_layout(vllm_config) == layout


def test_a_gpu_engines_request_is_freed_at_once_and_the_blocks_a_step_writes_afresh_are_fenced(tmp_path):
    """A GPU engine's request with stores planned is freed as soon as it finishes (vLLM can then
    reset its prefix cache, or sleep, at once: a request holding its blocks for a store made that
    fail, or wait for a step that an idle engine never takes). Each step's plan names the blocks
    vLLM allocated afresh for its forward (a new or resumed request's past its computed tokens, those
    added to running ones), which the workers fence from stores still reading them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    address = f"unix://{tmp_path}/absent.sock"
    vllm_config, kv_cache_config = engine_config(tmp_path, device="cuda", extra_config={"address": address})
    connector = KVTierConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    block = vllm_config.cache_config.block_size
    try:
        request = SimpleNamespace(
            request_id="r", block_hashes=[b"a" * 32, b"b" * 32], num_prompt_tokens=2 * block + 1, num_computed_tokens=0,
            kv_transfer_params=None,
        )  # fmt: skip
        connector.get_num_new_matched_tokens(request, 0)
        blocks = SimpleNamespace(get_block_ids=lambda req_id: ([4, 5],))
        new = SimpleNamespace(block_ids=([1, 2, 3],), num_computed_tokens=block)  # its first block a prefix-cache hit
        step = SimpleNamespace(
            num_scheduled_tokens={"r": 2 * block},
            kv_connector_block_state=blocks,
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=["running", "idle", "resumed"],
                new_block_ids=[([6],), None, ([9, 7, 8],)],  # (a resumed request's: all its blocks)
                num_computed_tokens=[5 * block, 6 * block, block],  # (its first block a prefix-cache hit)
                resumed_req_ids={"resumed"},
            ),
        )
        plan = connector.build_connector_meta(step).plan
        assert [job.block_ids for job in plan.stores] == [[4, 5]]
        assert plan.fresh_blocks == [2, 3, 6, 7, 8]
        assert connector.request_finished(request, [4, 5]) == (False, None)
    finally:
        connector.shutdown()


def test_handle_preemptions_fences_the_blocks_the_step_writes_afresh(daemon, tmp_path, monkeypatch):
    """vLLM calls handle_preemptions before each step's forward: the store calls still reading a
    block the step allocated afresh are withdrawn (sending again the jobs reading none of them)."""
    from blocks import chain_hashes
    from test_engine_logic import engine_spec, queued_gpu_stores, wait
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.engine.jobs import StepPlan, StoreJob
    from kvtier.engine.link import DaemonLink

    link = DaemonLink(daemon.address, "pytest-engine", timeout=10.0, reconnect_interval=0.2)
    link.set_namespace_spec(engine_spec())
    vllm_config, kv_cache_config = engine_config(tmp_path, device="cuda", extra_config={"address": daemon.address})
    connector = KVTierConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    try:
        worker, sent, stuck = queued_gpu_stores(link, 12, monkeypatch)
        connector._transfers = worker  # (a CPU cache here: the GPU copy itself is recorded)
        hashes = chain_hashes("step-fence", 2)
        worker._pending_gpu_stores = 1
        worker._submit_gpu_store([StoreJob("finished", [3], hashes[:1]), StoreJob("live", [4], hashes[1:])], ready=1)
        connector.handle_preemptions(KVTierMetadata(StepPlan(namespace_spec=worker._spec, fresh_blocks=[3])))
        stuck.set()
        wait(lambda: worker._pending_gpu_stores == 0)
        assert sent == [([4], 1)]
    finally:
        connector.shutdown()
        link.close()


def test_a_gpu_engine_in_sleep_mode_runs_without_the_cache_on_a_vllm_that_does_not_say_when_it_sleeps(daemon, tmp_path):
    """vLLM 0.32 unmaps a sleeping engine's KV cache without telling connectors (0.33 calls
    unregister_kv_caches): stores under way would read unmapped memory, so the connector stands aside."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    if hasattr(KVConnectorBase_V1, "unregister_kv_caches"):
        pytest.skip("this vLLM tells connectors when it sleeps")
    request = SimpleNamespace(
        request_id="r", block_hashes=[b"a" * 32], num_prompt_tokens=33, num_computed_tokens=0, kv_transfer_params=None
    )
    answers = []
    for sleep_mode in (False, True):
        vllm_config, kv_cache_config = engine_config(tmp_path, device="cuda", extra_config={"address": daemon.address})
        vllm_config.model_config.enable_sleep_mode = sleep_mode
        connector = KVTierConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        try:
            answers.append(connector.get_num_new_matched_tokens(request, 0))
        finally:
            connector.shutdown()
    assert answers == [(None, False), (0, False)]  # (looking it up; no lookup at all)


def test_speculative_decoding_on_the_targets_hidden_states_drops_the_last_block_of_hits():
    """As vLLM's scheduler decides for its own prefix cache (SpeculativeConfig.use_eagle_block_drop)."""
    from vllm.config import SpeculativeConfig

    from kvtier.vllm import drops_last_hit_block

    def config(method, disable=False):
        speculative = SpeculativeConfig.__new__(SpeculativeConfig)  # (a real one needs the draft model's files)
        object.__setattr__(speculative, "method", method)
        object.__setattr__(speculative, "disable_eagle_block_drop", disable)
        return SimpleNamespace(speculative_config=speculative)

    assert drops_last_hit_block(config("eagle3")) and drops_last_hit_block(config("mtp"))
    assert not drops_last_hit_block(config("eagle", disable=True))
    assert not drops_last_hit_block(config("ngram"))
    assert not drops_last_hit_block(SimpleNamespace(speculative_config=None))


def test_a_hub_models_revision_counts_as_the_commit_it_resolved_to(tmp_path):
    """vLLM resolves a hub model's revision once, to a ResolvedRevision whose string is the branch
    ("main"): the namespace takes its commit, so the model updated on the hub is another namespace,
    and the same commit asked for by branch or by hash is the same one."""
    import pickle

    from huggingface_hub import ResolvedRevision

    old, new = "a" * 40, "b" * 40
    main = ResolvedRevision(old)
    assert str(main) == "main" and pickle.loads(pickle.dumps(main)).resolved == old  # (as vLLM sends it on)
    assert digest(tmp_path, revision=main) == digest(tmp_path, revision=ResolvedRevision(old, initial=old))
    assert digest(tmp_path, revision=main) != digest(tmp_path, revision=ResolvedRevision(new))
    assert digest(tmp_path, revision="v2") != digest(tmp_path)  # (a revision vLLM did not resolve: as given)


def test_the_scheduler_connector_registers_its_models_files(tmp_path):
    """The scheduler's connector identifies its model while the engine starts, and its namespace
    carries the model directory's fingerprint (another copy of the files: the same one)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.model_files import files_fingerprint

    vllm_config, kv_cache_config = engine_config(tmp_path, extra_config={"address": f"unix://{tmp_path}/absent.sock"})
    connector = KVTierConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        assert connector._scheduler_planner() is not None  # (no daemon: the planner is made all the same)
        assert connector._link._spec.extra["files"] == files_fingerprint(tmp_path / "model")
        assert connector._link._spec == spec_of(tmp_path)
    finally:
        connector.shutdown()


def test_pipeline_stages_are_part_of_the_namespace(tmp_path):
    spec = spec_of(tmp_path, parallel={"pipeline_parallel_size": 2})
    assert (spec.pp_size, spec.pp_rank) == (2, 0)  # the scheduler's: stage 0 (each worker sets its own)


def test_engines_whose_blocks_are_not_their_hashes_tokens_run_without_the_cache(tmp_path):
    """Sliding-window attention (blocks outside the window are vLLM's null block), non-causal
    layers (Prefix LM: a prefix's KV depends on what follows it), context parallelism (a scheduler
    block spans several workers' blocks) and hashes over another span of tokens than a block are
    refused: the connector then serves nothing."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=64)
    prefix_lm = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32, non_causal=True)
    for changes, reason in [
        ({"kv_spec": window}, "full attention only"),
        ({"kv_spec": prefix_lm}, "causal attention only"),
        ({"parallel": {"decode_context_parallel_size": 2}}, "context parallelism"),
        ({"parallel": {"prefill_context_parallel_size": 2}}, "context parallelism"),
        ({"hash_block_size": 32}, "one block size"),
    ]:
        with pytest.raises(ValueError, match=reason):
            spec_of(tmp_path, **changes)
