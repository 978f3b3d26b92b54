"""KVTierConnector: vLLM's KV connector for kvtierd (vLLM 0.32 and 0.33).

    --kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"address": "unix:///run/kvtierd/kvtierd.sock"}}'

A thin adapter: the decisions live in kvtier.engine (vLLM-free). Every hook is guarded so that a
failure inside the connector, or a daemon that is absent, slow or restarting, costs cache hits and
never a request: lookups become misses, failed loads are reported so vLLM recomputes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.engine.adapter_keys import AdapterKeys
from kvtier.engine.jobs import StepPlan
from kvtier.engine.kv_blocks import LayerMajorKV
from kvtier.engine.link import DaemonLink
from kvtier.engine.rank_keys import key_bytes
from kvtier.engine.scheduler import PrefixPlanner
from kvtier.engine.worker import BlockTransfers
from kvtier.model_files import files_fingerprint
from kvtier.v1 import kvtier_pb2 as pb

log = logging.getLogger("kvtier.vllm")

NAMESPACE_LAYOUT = "vllm-layer-major-blocks"
UNSPLIT_BLOCK_TOKENS = 64  # the largest block no CUDA attention backend splits into kernel blocks


@dataclass(frozen=True)
class ConnectorConfig:
    """`kv_connector_extra_config` keys."""

    address: str | None = None  # default: the daemon's default socket
    offload_prompt_only: bool = True
    timeout_s: float = 2.0  # per daemon call
    lookup_wait_s: float = 1.0  # how long a request may wait for its lookup answer
    reconnect_interval_s: float = 1.0
    max_pending_store_bytes: int = 512 << 20
    engine_name: str = ""
    debug_load_delay_s: float = 0.0  # wait before each load (widens race windows in tests; leave 0)
    block_outermost_layout: bool | None = None  # GPU engines ask vLLM for BLHNC (one run per block); None: when safe
    namespace_extra: dict = field(default_factory=dict)  # added to the namespace digest

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        known = {k: v for k, v in extra.items() if k in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            log.warning("unknown kv_connector_extra_config keys ignored: %s", unknown)
        return cls(**known)


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    plan: StepPlan


class KVTierStats(KVConnectorStats):
    """Counters since the last report (see kvtier.engine.scheduler.SchedulerStats and worker.WorkerStats)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def guarded(default=None):
    """A failing hook logs and returns `default` instead of raising into vLLM."""

    def wrap(method):
        @functools.wraps(method)
        def hook(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception:
                log.exception("kvtier connector hook %s failed; continuing without the cache", method.__name__)
                return default() if callable(default) else default

        return hook

    return wrap


def namespace_spec(vllm_config, kv_cache_config, config: ConnectorConfig, identity: dict[str, str]) -> pb.NamespaceSpec:
    """Everything that makes this engine's KV bytes for a block hash interchangeable with another's
    (`identity`: the model's, from model_identity)."""
    from vllm.v1.core import kv_cache_utils  # noqa: PLC0415 (NONE_HASH is set when the engine starts)

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvtier supports models with one KV cache group, not {len(groups)}")
    spec = groups[0].kv_cache_spec
    check_supported(vllm_config, kv_cache_config, spec)
    layers = len(groups[0].layer_names)
    page = spec.page_size_bytes
    none_hash = getattr(kv_cache_utils, "NONE_HASH", b"") or b""
    model_config, cache_config, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    return pb.NamespaceSpec(
        model_id=str(model_config.model),
        tokens_per_block=cache_config.block_size,
        kv_dtype=str(spec.dtype),
        layout=f"{NAMESPACE_LAYOUT}:{getattr(kv_cache_config, 'kv_cache_layout', '') or ''}",
        num_layers=layers,
        num_kv_heads=getattr(spec, "num_kv_heads", 0),
        head_size=getattr(spec, "head_size", 0),
        block_bytes=page * layers,
        chunk_bytes=[page] * layers,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=0,
        pp_size=parallel.pipeline_parallel_size,
        pp_rank=0,
        hash_algorithm=str(cache_config.prefix_caching_hash_algo),
        hash_seed=bytes(none_hash).hex(),
        hash_bytes=key_bytes(len(none_hash) or 32, parallel.tensor_parallel_size),
        extra={**identity, **kv_format(cache_config), **{str(k): str(v) for k, v in config.namespace_extra.items()}},
    )


def kv_format(cache_config) -> dict[str, str]:
    """How the KV values are encoded beyond their torch dtype: vLLM keeps every fp8 format (fp8,
    fp8_e4m3, fp8_e5m2) and other quantized caches in uint8, so the same bytes mean other values
    under another --kv-cache-dtype; layers left out of the quantization change them too. Only when
    set (the model's own dtype, "auto", is the torch dtype), so other namespaces stay as they were."""
    encoding = {}
    if (dtype := str(getattr(cache_config, "cache_dtype", "auto"))) != "auto":
        encoding["kv_cache_dtype"] = dtype
    if skipped := getattr(cache_config, "kv_cache_dtype_skip_layers", None):
        encoding["kv_cache_dtype_skip_layers"] = ",".join(sorted(map(str, skipped)))  # (a set: in any order)
    return encoding


def check_supported(vllm_config, kv_cache_config, spec) -> None:
    """Refuse (ValueError: the engine runs without the cache) what would make a block's bytes not
    those of its hash's tokens: attention other than full (a sliding window's blocks outside it are
    vLLM's null block) or not causal (a Prefix-LM layer's KV of a prefix depends on the tokens after
    it: vLLM turns its own prefix cache off for such models, but still hashes blocks for a
    connector), context parallelism (a scheduler block spans several workers' blocks, and the hashes
    with it), or hashes over other spans of tokens than a block."""
    from vllm.v1 import kv_cache_interface  # noqa: PLC0415

    full = tuple(getattr(kv_cache_interface, name, None) for name in ("FullAttentionSpec", "MLAAttentionSpec"))
    if type(spec) not in full or getattr(spec, "tokens_per_state", 1) != 1:
        raise ValueError(f"kvtier supports full attention only, not {type(spec).__name__}")
    if getattr(spec, "non_causal", False):
        raise ValueError("kvtier supports causal attention only (this model has non-causal layers)")
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            raise ValueError(f"kvtier does not support context parallelism ({name} {getattr(parallel, name)})")
    block_size = vllm_config.cache_config.block_size
    sizes = {"KV cache spec block_size": spec.block_size, "hash_block_size": getattr(kv_cache_config, "hash_block_size", None)}
    for name, size in sizes.items():
        if size is not None and size != block_size:
            raise ValueError(f"kvtier needs one block size: {name} {size} != cache block_size {block_size}")


def model_identity(vllm_config) -> dict[str, str]:
    """What besides its name makes a model's KV values: its revision, quantization and compute dtype,
    where its HF config comes from (hf_config_path, its revision, code_revision), its hf_overrides
    (rope scaling, ...; a function by its code), a hub model's revisions as the commits vLLM resolved
    them to (a branch moves), where its weights come from when vLLM pulled the
    configs apart from them (model_weights: object storage), random weights (load_format dummy),
    tensorizer weights (their URI, and a local file's contents),
    and for a local model (and config) directory or file the names, sizes and contents of its model
    files (model_files: another model copied under the same path is another namespace, the same
    files copied anew are not). Not the loaded HF config: model code may change it while the engine
    loads the model, in this process or only in a worker's, so engines that should share would not."""
    model_config = vllm_config.model_config
    overrides = getattr(model_config, "hf_overrides", None) or {}
    if callable(overrides):
        code = getattr(overrides, "__code__", None)
        digest = _code_digest(code) if code is not None else repr(overrides)
        overrides = f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}:{digest}"
    config_path = getattr(model_config, "hf_config_path", None)
    identity = {
        "revision": _commit(model_config.revision),
        "quantization": str(getattr(model_config, "quantization", None) or ""),
        "dtype": str(getattr(model_config, "dtype", "")),
        "hf_overrides": json.dumps(overrides, sort_keys=True, default=str),
        "hf_config_path": str(config_path or ""),
        "config_revision": _commit(getattr(model_config, "_hf_config_revision", None)),  # (None: the model's repo)
        "code_revision": str(getattr(model_config, "code_revision", None) or ""),
    }
    if weights := getattr(model_config, "model_weights", ""):
        identity["model_weights"] = str(weights)
    load_config = getattr(vllm_config, "load_config", None)
    load_format = str(getattr(load_config, "load_format", ""))
    if load_format == "dummy":
        identity["load_format"] = "dummy"
    if tensors := (_tensorizer_uri(load_config) if load_format == "tensorizer" else ""):
        identity["tensorizer_uri"] = tensors
    for key, path in (("files", model_config.model), ("config_files", config_path), ("tensorizer_files", tensors)):
        if path and os.path.exists(str(path)):
            identity[key] = files_fingerprint(Path(str(path)))
    return identity


def _tensorizer_uri(load_config) -> str:
    """Where a tensorizer-loaded model's weights are (--model then names only its config): its
    tensorizer_uri, or tensorizer_dir; not the rest of the config, which may hold S3 credentials."""
    config = getattr(load_config, "model_loader_extra_config", None) or {}
    if isinstance(config, dict):
        config = config.get("tensorizer_config", config)
    get = config.get if hasattr(config, "get") else lambda key: getattr(config, key, None)
    return str(get("tensorizer_uri") or get("tensorizer_dir") or "")


def _commit(revision) -> str:
    """A hub revision as the commit it resolved to: vLLM resolves each once, to a huggingface_hub
    ResolvedRevision, whose string is the branch asked for ("main", which moves) and whose
    `resolved` is the commit; any other revision as given."""
    return str(getattr(revision, "resolved", None) or revision or "")


def _code_digest(code) -> str:
    """A function's bytecode, names and plain constants (the same in every process running it)."""
    constants = [c for c in code.co_consts if not hasattr(c, "co_code")]
    return hashlib.sha256(code.co_code + repr((constants, code.co_names)).encode()).hexdigest()


def worker_ranks() -> tuple[int, int]:
    """This worker's tensor-parallel rank and pipeline stage (0 without those groups)."""
    from vllm.distributed import parallel_state  # noqa: PLC0415

    def rank(get) -> int:
        try:
            return get()
        except Exception:  # noqa: BLE001 (no such group: a single worker)
            return 0

    return rank(parallel_state.get_tensor_model_parallel_rank), rank(lambda: parallel_state.get_pp_group().rank_in_group)


def _recompute_failed_loads(kv_transfer_config) -> None:
    """kvtier is a cache: a load that fails (the daemon gone, a block deleted or corrupt) is a miss,
    and vLLM recomputes those tokens. vLLM's default policy ("fail", since 0.32) would fail the
    request instead; its scheduler reads the policy just after it makes its connector (0.32 and
    0.33), so the scheduler's connector sets it here. Inside a MultiConnector this connector has a
    copy of its own, and the MultiConnector's policy (the one the scheduler reads) must be set there."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        kv_transfer_config.kv_load_failure_policy = "recompute"
        log.warning(
            "kv_load_failure_policy was %r; kvtier sets it to 'recompute': a failed load is a cache miss, "
            "recomputed, never a failed request (inside a MultiConnector, set it on the MultiConnector's "
            "kv-transfer-config: this connector only sees a copy)",
            policy,
        )


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = ConnectorConfig.from_extra(extra)
        self._block_size = vllm_config.cache_config.block_size
        name = self.config.engine_name or f"vllm-{role.name.lower()}-{os.getpid()}"
        self._link = DaemonLink(self.config.address, name, self.config.timeout_s, self.config.reconnect_interval_s)
        self._planner: PrefixPlanner | None = None
        self._unsupported = False
        self._transfers: BlockTransfers | None = None
        self._requests: dict[str, Any] = {}
        self._adapter_keys = AdapterKeys()  # a LoRA request's keys carry its adapter's files
        self._failed_loads: set[str] = set()
        self._vllm_config = vllm_config
        self._link.connect_soon(map_pool=role == KVConnectorRole.WORKER and not _on_gpu(vllm_config))
        self._identity: dict[str, str] = {}
        if _sleeps_unseen(vllm_config):
            log.error(
                "kvtier: sleep mode on a GPU engine needs vLLM 0.33 or newer, which tells the connector when the KV "
                "cache is unmapped (stores under way would read it); the engine runs without the cache"
            )
            self._unsupported = True
        if role == KVConnectorRole.SCHEDULER and not self._unsupported:
            _recompute_failed_loads(self._kv_transfer_config)
            try:  # (reads the model's files: while the engine starts, not in its first request's step)
                self._identity = model_identity(vllm_config)
            except Exception:
                log.exception("kvtier cannot identify this engine's model; it runs without the cache")
                self._unsupported = True

    def _scheduler_planner(self) -> PrefixPlanner | None:
        """Made on first use: the namespace includes vLLM's NONE_HASH, set after connectors are built."""
        if self._planner is None and self._role == KVConnectorRole.SCHEDULER and not self._unsupported:
            try:
                self._planner = self._new_planner()
            except Exception:
                log.exception("kvtier cannot serve this engine; it runs without the cache")
                self._unsupported = True
        return self._planner

    def _new_planner(self) -> PrefixPlanner:
        return PrefixPlanner(
            self._link,
            self._block_size,
            self._registered_spec().SerializeToString(deterministic=True),
            offload_prompt_only=self.config.offload_prompt_only,
            lookup_wait_s=self.config.lookup_wait_s,
            drop_last_hit_block=drops_last_hit_block(self._vllm_config),
        )

    def _registered_spec(self) -> pb.NamespaceSpec:
        """The engine's namespace, registered for the scheduler's calls (the workers get it in each step's plan)."""
        spec = namespace_spec(self._vllm_config, self._kv_cache_config, self.config, self._identity)
        self._link.set_namespace_spec(spec)
        return spec

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """Block-outermost on GPUs (where every attention backend accepts it, vLLM uses it; otherwise
        it warns and keeps a layer-major layout, which works too). Not by default for blocks of more
        than UNSPLIT_BLOCK_TOKENS tokens: a backend whose kernels take smaller blocks (FlashInfer's
        16/32/64, FlashMLA's 64) splits each block, which a block-outermost layout cannot hold, and
        vLLM then refuses to start."""
        wanted = ConnectorConfig.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config or {}).block_outermost_layout
        if wanted is None:
            wanted = vllm_config.cache_config.block_size <= UNSPLIT_BLOCK_TOKENS
        return "BLHNC" if _on_gpu(vllm_config) and wanted else None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: nothing depends on a store arriving

    # ------------------------------------------------------------------ scheduler side

    @guarded(default=lambda: (0, False))
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        planner = self._scheduler_planner()
        if planner is None:
            return 0, False
        hashes = self._adapter_keys.keys(request.request_id, getattr(request, "lora_request", None), request.block_hashes)
        if hashes is None:  # (an adapter with no local files to tell its versions apart)
            return 0, False
        self._requests[request.request_id] = request
        params = getattr(request, "kv_transfer_params", None) or {}
        max_offload = params.get("max_offload_tokens")
        return planner.matched_tokens(
            request.request_id,
            hashes,
            request.num_prompt_tokens,
            num_computed_tokens,
            int(max_offload) if max_offload is not None else None,
        )

    @guarded()
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._planner is not None and num_external_tokens > 0:
            self._planner.after_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    @guarded(default=lambda: KVTierMetadata(StepPlan(fence_all=True)))  # (fails closed: see StepPlan)
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        planner = self._scheduler_planner()
        if planner is None:
            return KVTierMetadata(StepPlan())
        fresh = _fresh_blocks(scheduler_output, self._block_size) if _on_gpu(self._vllm_config) else None
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        scheduled = []
        for req_id, tokens in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            if block_state is not None:
                block_ids = block_state.get_block_ids(req_id)[0]
            else:
                block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            hashes = self._adapter_keys.keys(req_id, getattr(request, "lora_request", None), request.block_hashes)
            scheduled.append((req_id, request.num_computed_tokens + tokens, hashes, list(block_ids)))
        return KVTierMetadata(planner.plan_step(scheduled, fresh))

    @guarded(default=False)
    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True): RL frameworks call it after replacing the
        model's weights in place, and vLLM when it pauses or sleeps. The namespace, made from the
        model's files, would hand out KV of the old weights: from now on this engine's blocks go to
        a namespace of its own (a random salt: nothing tells which engines share the new weights),
        and its requests so far neither load nor store."""
        self._identity["reset"] = secrets.token_hex(8)
        if self._planner is not None:
            self._planner.renamespace(self._registered_spec().SerializeToString(deterministic=True))
        log.warning("kvtier: prefix cache reset (new weights?); this engine's blocks go to a namespace of its own from now on")
        return True

    @guarded()
    def update_connector_output(self, connector_output) -> None:
        if self._planner is not None:
            failed = getattr(connector_output, "failed_recving", None) or set()
            self._planner.on_transfers(set(connector_output.finished_recving or ()), set(failed))

    @guarded(default=lambda: (False, None))
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._adapter_keys.forget(request.request_id)
        # An unfinished load delays the free; stores never do (see PrefixPlanner.finished).
        loading = self._planner is not None and self._planner.finished(request.request_id)
        return loading, None

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        try:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: PLC0415 (absent in older vLLM)
        except ImportError:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {CacheHitSource.HOST: num_external_tokens} if num_external_tokens else {}

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict) -> None:
        try:
            tensors = list(kv_caches.values())
            if self._unsupported:
                kv = None
            elif tensors and tensors[0].device.type == "cuda":
                from kvtier.engine.gpu_kv import GpuKV  # noqa: PLC0415 (CUDA engines only)

                kv = GpuKV(tensors, self._kv_cache_config.num_blocks)
            else:
                kv = LayerMajorKV(tensors)
        except Exception:
            log.exception("kvtier cannot use this KV cache layout; the engine runs without the cache")
            kv = None
        tp_rank, pp_rank = worker_ranks()
        self._transfers = BlockTransfers(
            self._link,
            kv,
            self.config.max_pending_store_bytes,
            tp_rank,
            self.config.debug_load_delay_s,
            pp_rank=pp_rank,
        )
        if kv is not None:
            log.info("kvtier connector ready: %d layers, %d bytes per block", len(kv_caches), kv.block_bytes)

    # vLLM 0.33's sleep mode (0.32 calls neither): the KV cache's memory goes away and comes back
    @guarded()
    def unregister_kv_caches(self) -> None:
        if self._transfers is not None:
            self._transfers.sleep()

    @guarded()
    def restore_kv_caches(self) -> None:
        if self._transfers is not None:
            self._transfers.wake()

    def _plan(self) -> StepPlan | None:
        if self._transfers is None or not self.has_connector_metadata():
            return None
        plan = self._get_connector_metadata().plan
        self._transfers.configure(plan.namespace_spec)
        return plan

    @guarded()
    def start_load_kv(self, forward_context, **kwargs) -> None:
        plan = self._plan()
        if plan is not None and plan.loads:
            self._transfers.start_loads(plan.loads)  # never raises: failures are reported per request

    @guarded()
    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Called in every step before its forward (0.32 and 0.33): blocks allocated afresh for it may
        have been a finished or preempted request's, still read by its stores; those end first."""
        plan = getattr(kv_connector_metadata, "plan", None)
        if self._transfers is not None and plan is not None and (plan.fresh_blocks or plan.fence_all):
            try:
                self._transfers.configure(plan.namespace_spec)  # (a call withdrawn now goes again only into its own)
            finally:
                self._transfers.fence(None if plan.fence_all else set(plan.fresh_blocks))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole-request and asynchronous

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # stores copy whole blocks in wait_for_save

    @guarded()
    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is not None and plan.stores:
            self._transfers.save(plan.stores)

    @guarded(default=(None, None))
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._transfers is None:
            return None, None
        finished, failed = self._transfers.finished_loads()
        self._failed_loads |= failed
        return None, finished or None  # (stores never hold a request's blocks: see handle_preemptions)

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving = self._failed_loads & set(results.finished_recving)
        self._failed_loads -= results.failed_recving
        return results

    # ------------------------------------------------------------------ stats and lifecycle

    @guarded()
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._planner is not None:
            stats, self._planner.stats = self._planner.stats, type(self._planner.stats)()
        elif self._transfers is not None:
            stats = self._transfers.take_stats()
        else:
            return None
        result = KVTierStats(data=asdict(stats))
        return None if result.is_empty() else result

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierStats(data=dict(data)) if data else None

    @guarded()
    def shutdown(self) -> None:
        self._link.close()


def drops_last_hit_block(vllm_config) -> bool:
    """Whether vLLM drops the last block of its own prefix cache hits (speculative decoding on the
    target's hidden states: EAGLE, MTP; the draft layers' KV of that block was computed with the
    tokens after it), and so must the connector's hits."""
    speculative = getattr(vllm_config, "speculative_config", None)
    drops = getattr(speculative, "use_eagle_block_drop", None) or getattr(speculative, "use_eagle", None)
    return bool(drops and drops())


def _fresh_blocks(scheduler_output, block_size: int) -> list[int]:
    """The blocks vLLM allocated afresh for this step's forward: a new or resumed request's blocks
    past its computed tokens (those before are prefix-cache hits, or the blocks a load filled; a
    resumed request's new_block_ids are all its blocks), and the blocks added to running requests."""
    fresh: list[int] = []
    for new in scheduler_output.scheduled_new_reqs:
        fresh += new.block_ids[0][new.num_computed_tokens // block_size :]
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, added, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
        if added is not None:
            fresh += added[0][computed // block_size :] if req_id in cached.resumed_req_ids else added[0]
    return fresh


def _sleeps_unseen(vllm_config) -> bool:
    """A GPU engine in sleep mode on a vLLM (0.32) that does not tell connectors when it unmaps the KV
    cache (`unregister_kv_caches`)."""
    sleep_mode = getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False)
    return _on_gpu(vllm_config) and bool(sleep_mode) and not hasattr(KVConnectorBase_V1, "unregister_kv_caches")


def _on_gpu(vllm_config) -> bool:
    return getattr(getattr(vllm_config, "device_config", None), "device_type", "") == "cuda"
