"""The connector's vLLM-free logic against a real daemon: link, scheduler planning, worker transfers."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import threading
import time
import urllib.request
from concurrent.futures import CancelledError, Future
from pathlib import Path

import grpc
import pytest
from blocks import chain_hashes, spec

torch = pytest.importorskip("torch")

from kvtier.client import KVTierClient  # noqa: E402
from kvtier.data_socket import DataSocketError  # noqa: E402
from kvtier.engine import scheduler as scheduler_module  # noqa: E402
from kvtier.engine import worker as worker_module  # noqa: E402
from kvtier.engine.jobs import LoadJob, StoreJob  # noqa: E402
from kvtier.engine.kv_blocks import LayerMajorKV  # noqa: E402
from kvtier.engine.link import DaemonLink, DaemonUnavailable, call_error  # noqa: E402
from kvtier.engine.rank_keys import key_bytes, rank_suffix  # noqa: E402
from kvtier.engine.scheduler import PrefixPlanner  # noqa: E402
from kvtier.engine.worker import MAX_PENDING_GPU_STORES, BlockTransfers, DeviceCall  # noqa: E402
from kvtier.v1 import kvtier_pb2 as pb  # noqa: E402

BLOCK_TOKENS = 16
LAYERS, BLOCKS, HEADS, HEAD = 3, 32, 2, 8


def kv_cache(seed: int) -> list[torch.Tensor]:
    """vLLM CPU layout: per layer [num_blocks, kv_heads, block_size, 2 * head_size]."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, BLOCK_TOKENS, 2 * HEAD, generator=generator) for _ in range(LAYERS)]


def engine_spec():
    block_bytes = HEADS * BLOCK_TOKENS * 2 * HEAD * 4 * LAYERS
    return spec(block_bytes=block_bytes, tokens_per_block=BLOCK_TOKENS, chunk_bytes=[block_bytes // LAYERS] * LAYERS)


def wait(future_or_predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if future_or_predicate():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


@pytest.fixture
def link(daemon):
    link = DaemonLink(daemon.address, "pytest-engine", timeout=10.0, reconnect_interval=0.2)
    link.set_namespace_spec(engine_spec())
    yield link
    link.close()


def transfers(link, seed) -> tuple[BlockTransfers, list[torch.Tensor]]:
    layers = kv_cache(seed)
    worker = BlockTransfers(link, LayerMajorKV(layers))
    worker.configure(engine_spec().SerializeToString(deterministic=True))
    return worker, layers


def drain_loads(worker: BlockTransfers) -> tuple[set[str], set[str]]:
    done: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + 10
    while worker._loads and time.monotonic() < deadline:
        finished, bad = worker.finished_loads()
        done |= finished
        failed |= bad
        time.sleep(0.01)
    return done, failed


def test_call_error_takes_a_done_calls_error_without_any_traceback_chained_to_it():
    def failed_call() -> Future:
        future = Future()
        try:
            try:
                raise KeyError("context")
            except KeyError:
                raise DaemonUnavailable("call") from OSError("cause")
        except DaemonUnavailable as exc:
            future.set_exception(exc)
        return future

    future = failed_call()
    error = call_error(future)
    assert isinstance(error, DaemonUnavailable) and future.exception() is error
    assert error.__traceback__ is None and error.__cause__.__traceback__ is None and error.__context__.__traceback__ is None
    looped = DaemonUnavailable("a")
    looped.__cause__ = OSError("b")
    looped.__cause__.__context__ = looped  # (a chain that comes back: taken once)
    future = Future()
    future.set_exception(looped)
    assert call_error(future) is looped
    withdrawn, answered = Future(), Future()
    withdrawn.cancel()
    answered.set_result(3)
    assert isinstance(call_error(withdrawn), CancelledError) and call_error(answered) is None


def test_failed_calls_leave_nothing_to_the_garbage_collector_and_a_crashed_daemons_pool_is_unmapped(start_daemon):
    """With the cyclic garbage collector off: a failed load, a pinned load and failed stores, then
    the daemon crashes. A failed call's error, raised into the engine's frame, used to tie its future,
    its traceback's frames and what they held (a pinned load's view of the pool, a store's block
    copies) into cycles that only a full collection freed: the old pool stayed mapped, and a
    restarted daemon found no room for its own in /dev/shm."""
    daemon = start_daemon("--pool-size", "16MiB")
    link = DaemonLink(daemon.address, "pytest-engine", timeout=2.0, reconnect_interval=0.2)
    link.set_namespace_spec(engine_spec())
    pool_file = str(daemon.shm_dir)

    def pool_mapped() -> bool:
        return pool_file in Path("/proc/self/maps").read_text()

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        worker, _ = transfers(link, seed=1)
        hashes = chain_hashes("mapped", 3)
        worker.save([StoreJob("s", [0, 1, 2], hashes)])
        wait(lambda: worker.stats.stored_blocks == 3)
        worker.start_loads([LoadJob("evicted", [7, 8, 9], chain_hashes("gone", 3)), LoadJob("ok", [4, 5, 6], hashes)])
        assert drain_loads(worker) == ({"evicted", "ok"}, {"evicted"})
        assert pool_mapped()
        daemon.process.kill()
        daemon.process.wait()
        worker.save([StoreJob("late", [10, 11], chain_hashes("late", 2))])  # (fails: the daemon is gone)
        wait(lambda: worker.stats.store_failures == 2)
        wait(lambda: not pool_mapped())  # the link dropped the session: nothing else holds the mapping
        gc.collect()
        ours = [o for o in gc.garbage if type(o) is Future or type(o).__module__.startswith("kvtier")]
        frames = [o for o in gc.garbage if type(o).__name__ == "frame" and "/kvtier/" in o.f_code.co_filename]
        assert not ours and not frames, (ours[:5], frames[:5])  # (grpc's own stream objects may be there)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        link.close()


def test_store_in_one_engine_load_in_another_is_byte_exact(link):
    a, layers_a = transfers(link, seed=1)
    b, layers_b = transfers(link, seed=2)
    hashes = chain_hashes("engine", 5)
    a.save([StoreJob("r1", [3, 7, 9], hashes[:3]), StoreJob("r2", [20, 21], hashes[3:])])
    wait(lambda: a.stats.stored_blocks == 5)
    b.start_loads([LoadJob("r9", [0, 1, 2, 30, 31], hashes)])
    done, failed = drain_loads(b)
    assert done == {"r9"} and not failed
    for la, lb in zip(layers_a, layers_b, strict=True):
        for src, dst in zip([3, 7, 9, 20, 21], [0, 1, 2, 30, 31], strict=True):
            assert torch.equal(la[src], lb[dst])
    assert b.stats.loaded_blocks == 5


@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_stages_of_a_pipeline_parallel_engine_keep_blocks_of_their_own(daemon, tp_size):
    """Each stage holds other layers under the same block hashes: a stage loads what it stored
    itself, never another stage's layers. Each stage is a namespace; its TP ranks share it."""
    pipeline = tp_spec(tp_size)
    pipeline.pp_size = 2
    workers = [(stage, rank) for stage in range(2) for rank in range(tp_size)]
    links = [DaemonLink(daemon.address, f"stage-{stage}-{rank}", timeout=10.0, reconnect_interval=0.2) for stage, rank in workers]
    try:
        caches = []
        for (stage, rank), link in zip(workers, links, strict=True):
            layers = kv_cache(seed=10 * stage + rank)
            worker = BlockTransfers(link, LayerMajorKV(layers), tp_rank=rank, pp_rank=stage)
            worker.configure(pipeline.SerializeToString(deterministic=True))
            caches.append((worker, layers))
        hashes = chain_hashes("pipeline", 2)
        for worker, _ in caches:
            worker.save([StoreJob("r1", [0, 1], hashes)])
            wait(lambda worker=worker: worker.stats.stored_blocks == 2)
        worker, layers = caches[-1]  # the last stage's last rank
        worker.start_loads([LoadJob("r2", [5, 6], hashes)])
        assert drain_loads(worker) == ({"r2"}, set())
        assert all(torch.equal(layer[5:7], layer[0:2]) for layer in layers)  # its own blocks 0 and 1
        assert [n.blocks for n in daemon.admin("ListNamespaces").namespaces] == [2 * tp_size] * 2
    finally:
        for link in links:
            link.close()


def test_a_store_whose_commit_is_lost_on_its_way_leaves_no_reservation(link, daemon, monkeypatch):
    """A commit that fails in transport (the session still alive) is followed by an abort: its pages
    go back at once instead of staying reserved until the daemon's --lease-ttl."""
    worker, _ = transfers(link, seed=4)
    lost = grpc.RpcError("the connection broke while the commit was on its way")
    monkeypatch.setattr(KVTierClient, "commit", lambda self, *args, **kwargs: (_ for _ in ()).throw(lost))
    worker.save([StoreJob("r1", [0, 1], chain_hashes("lost-commit", 2))])
    wait(lambda: worker.stats.store_failures == 2)
    stats = daemon.admin("GetStats")
    assert stats.reserved_bytes == 0 and stats.pool_used_bytes == 0


def test_a_pipeline_stage_of_fewer_layers_keeps_blocks_of_its_own_size(daemon):
    """The scheduler's spec is stage 0's; a stage holding fewer layers (an uneven split) registers
    its stage's namespace with its own layers and block size instead of turning its transfers off."""
    pipeline = engine_spec()
    pipeline.pp_size = 2
    link = DaemonLink(daemon.address, "stage-1", timeout=10.0, reconnect_interval=0.2)
    try:
        layers = kv_cache(seed=6)[:-1]
        stage = BlockTransfers(link, LayerMajorKV(layers), pp_rank=1)
        stage.configure(pipeline.SerializeToString(deterministic=True))
        hashes = chain_hashes("short-stage", 2)
        stage.save([StoreJob("r1", [0, 1], hashes)])
        wait(lambda: stage.stats.stored_blocks == 2)
        stage.start_loads([LoadJob("r2", [5, 6], hashes)])
        assert drain_loads(stage) == ({"r2"}, set())
        assert all(torch.equal(layer[5:7], layer[0:2]) for layer in layers)
        (namespace,) = daemon.admin("ListNamespaces").namespaces
        assert (namespace.spec.pp_rank, namespace.spec.num_layers) == (1, LAYERS - 1)
        assert namespace.spec.block_bytes == pipeline.block_bytes // LAYERS * (LAYERS - 1)
    finally:
        link.close()


def test_sleep_waits_for_calls_holding_blocks_and_nothing_copies_until_wake(link):
    """vLLM's sleep mode unmaps the KV cache (unregister_kv_caches): sleep returns only once no call
    holds the engine's blocks, a call still waiting for the link copies nothing, and until wake
    (restore_kv_caches) loads fail and stores are skipped."""
    writer, _ = transfers(link, seed=8)
    hashes = chain_hashes("asleep", 2)
    writer.save([StoreJob("r1", [0, 1], hashes)])
    wait(lambda: writer.stats.stored_blocks == 2)
    target = [torch.zeros_like(layer) for layer in kv_cache(9)]
    worker = BlockTransfers(link, LayerMajorKV(target))
    worker.configure(engine_spec().SerializeToString(deterministic=True))
    stuck = threading.Event()
    link.submit(lambda client, ns: stuck.wait(30))
    worker.start_loads([LoadJob("queued", [5, 6], hashes)])  # waits for the link behind the stuck call
    asleep = threading.Thread(target=worker.sleep)
    asleep.start()
    asleep.join(0.3)
    assert asleep.is_alive()  # the queued load holds the blocks
    stuck.set()
    asleep.join(10)
    assert not asleep.is_alive() and drain_loads(worker) == ({"queued"}, {"queued"})
    assert all(not layer[5:7].any() for layer in target)  # nothing copied into the unmapped cache
    worker.save([StoreJob("r2", [3], chain_hashes("while-asleep", 1))])
    assert worker.stats.store_skipped_blocks == 1
    worker.start_loads([LoadJob("asleep", [5, 6], hashes)])
    assert drain_loads(worker) == ({"asleep"}, {"asleep"})
    worker.wake()
    worker.start_loads([LoadJob("awake", [5, 6], hashes)])
    assert drain_loads(worker) == ({"awake"}, set())


def test_loads_fail_when_blocks_are_gone_or_corrupt(link, daemon):
    a, _ = transfers(link, seed=1)
    b, _ = transfers(link, seed=2)
    hashes = chain_hashes("gone", 4)
    a.save([StoreJob("r1", [0, 1, 2, 3], hashes)])
    wait(lambda: a.stats.stored_blocks == 4)
    daemon.admin("DeleteBlocks", namespace=daemon.admin("ListNamespaces").namespaces[0].namespace, hashes=hashes[2])
    b.start_loads([LoadJob("partial", [5, 6, 7, 8], hashes)])
    assert drain_loads(b) == ({"partial"}, {"partial"})

    ns = daemon.admin("ListNamespaces").namespaces[0].namespace
    inspected = daemon.admin("InspectBlock", namespace=ns, hash=hashes[0])
    view = link.submit(lambda client, _: client.state.pool().view).result()
    page = int.from_bytes(inspected.page_ids[:4], "little")
    view.pages[page, 10] ^= 1
    b.start_loads([LoadJob("corrupt", [5, 6], hashes[:2])])
    assert drain_loads(b) == ({"corrupt"}, {"corrupt"})


def test_geometry_mismatch_disables_transfers_and_fails_loads(link):
    worker = BlockTransfers(link, LayerMajorKV(kv_cache(3)[:2]))  # two layers: other block size
    worker.configure(engine_spec().SerializeToString(deterministic=True))
    worker.save([StoreJob("r", [0], chain_hashes("x", 1))])
    worker.start_loads([LoadJob("r", [0], chain_hashes("x", 1))])
    assert worker.finished_loads() == ({"r"}, {"r"})


def planner_for(link) -> PrefixPlanner:
    return PrefixPlanner(link, BLOCK_TOKENS, engine_spec().SerializeToString(deterministic=True), lookup_wait_s=5.0)


def test_planner_asks_again_then_promises_only_what_is_cached(link, daemon):
    worker, _ = transfers(link, seed=1)
    hashes = chain_hashes("plan", 6)
    worker.save([StoreJob("seed", list(range(4)), hashes[:4])])
    wait(lambda: worker.stats.stored_blocks == 4)
    planner = planner_for(link)
    prompt_tokens = 6 * BLOCK_TOKENS  # the first 4 blocks cached
    whole = 4 * BLOCK_TOKENS  # a prompt of just the 4 cached blocks: its last token must stay to be computed
    assert planner.matched_tokens("r1", hashes, prompt_tokens, 0, None) == (None, False)
    assert planner.matched_tokens("r2", chain_hashes("other", 3), 3 * BLOCK_TOKENS + 5, 0, None) == (None, False)
    assert planner.matched_tokens("r3", hashes[:4], whole, 0, None) == (None, False)
    planner.plan_step([])  # one LookupBatch for the three requests
    wait(lambda: planner.matched_tokens("r1", hashes, prompt_tokens, 0, None) != (None, False))
    assert planner.matched_tokens("r1", hashes, prompt_tokens, 0, None) == (4 * BLOCK_TOKENS, True)
    assert planner.matched_tokens("r1", hashes, prompt_tokens, 2 * BLOCK_TOKENS, None) == (2 * BLOCK_TOKENS, True)
    assert planner.matched_tokens("r2", chain_hashes("other", 3), 3 * BLOCK_TOKENS + 5, 0, None) == (0, False)
    assert planner.matched_tokens("r3", hashes[:4], whole, 0, None) == (3 * BLOCK_TOKENS, True)
    port = daemon.admin("GetInfo").metrics_port
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert 'kvtierd_rpc_duration_seconds_count{method="LookupBatch"} 1.0' in metrics

    assert planner.matched_tokens("r1", hashes, prompt_tokens, 0, None) == (4 * BLOCK_TOKENS, True)  # vLLM's last ask
    planner.after_alloc("r1", list(range(10, 16)), 4 * BLOCK_TOKENS)
    with pytest.raises(TypeError):  # a plan that fails (the hook then plans nothing) loses neither loads nor stores
        planner.plan_step([("r1", prompt_tokens, hashes, list(range(10, 16))), ("r2", prompt_tokens, None, [])])
    plan = planner.plan_step([("r1", prompt_tokens, hashes, list(range(10, 16)))])
    assert [(j.block_ids, j.hashes) for j in plan.loads] == [([10, 11, 12, 13], hashes[:4])]
    assert [(j.block_ids, j.hashes) for j in plan.stores] == [([14, 15], hashes[4:6])]  # loaded blocks are not stored again
    planner.on_transfers({"r1"}, {"r1"})
    assert planner.matched_tokens("r1", hashes, prompt_tokens, 0, None) == (0, False)  # never offered again
    # the blocks it recomputes are stored again, once recomputed (a worker whose part failed gets its copy back)
    assert planner.plan_step([("r1", 2 * BLOCK_TOKENS, hashes, list(range(10, 16)))]).stores[0].block_ids == [10, 11]
    assert planner.plan_step([("r1", prompt_tokens, hashes, list(range(10, 16)))]).stores[0].block_ids == [12, 13, 14, 15]


def test_after_a_new_namespace_the_requests_known_before_neither_hit_nor_store(link):
    """After vLLM resets its prefix cache (weights replaced in place, or a pause) the planner's
    namespace changes: requests it knew may hold KV of the old weights, so they neither get the
    hits they were promised nor store what they compute; requests that come after do both."""
    worker, _ = transfers(link, seed=1)
    hashes = chain_hashes("renamespace", 4)
    worker.save([StoreJob("seed", list(range(4)), hashes)])
    wait(lambda: worker.stats.stored_blocks == 4)
    planner = planner_for(link)
    prompt = 4 * BLOCK_TOKENS + 1
    assert planner.matched_tokens("old", hashes, prompt, 0, None) == (None, False)
    planner.plan_step([])
    wait(lambda: planner.matched_tokens("old", hashes, prompt, 0, None) != (None, False))
    assert planner.matched_tokens("old", hashes, prompt, 0, None) == (4 * BLOCK_TOKENS, True)
    new_spec = engine_spec()
    new_spec.extra["reset"] = "1"
    planner.renamespace(new_spec.SerializeToString(deterministic=True))
    assert planner.matched_tokens("old", hashes, prompt, 0, None) == (0, False)
    plan = planner.plan_step([("old", prompt, hashes, [0, 1, 2, 3]), ("new", BLOCK_TOKENS, hashes, [4])])
    assert plan.namespace_spec == new_spec.SerializeToString(deterministic=True)
    assert [job.req_id for job in plan.stores] == []  # ("new" is not known to the planner yet)
    assert planner.matched_tokens("new", hashes[:1], BLOCK_TOKENS + 1, 0, None) == (None, False)
    assert [job.req_id for job in planner.plan_step([("new", BLOCK_TOKENS, hashes, [4])]).stores] == ["new"]


def test_an_engine_reset_more_often_than_the_daemons_namespace_limit_keeps_its_cache(start_daemon):
    """Each prefix cache reset moves the engine to a namespace of its own (RL frameworks reset after
    every weight update): its link leaves the one before, which the daemon retires when a new one
    needs room, so the engine goes on storing after more resets than --max-namespaces."""
    daemon = start_daemon("--pool-size", "64MiB", "--max-namespaces", "2")
    link = DaemonLink(daemon.address, "pytest-engine", timeout=10.0, reconnect_interval=0.2)
    link.set_namespace_spec(engine_spec())
    try:
        worker, _ = transfers(link, seed=3)
        for reset in range(5):
            new_spec = engine_spec()
            new_spec.extra["reset"] = str(reset)
            worker.configure(new_spec.SerializeToString(deterministic=True))
            worker.save([StoreJob(f"after-reset-{reset}", [0, 1], chain_hashes(f"reset-{reset}", 2))])
            wait(lambda stored=2 * (reset + 1): worker.stats.stored_blocks == stored)
        assert worker.stats.store_failures == 0
        kept = {n.namespace: n for n in daemon.admin("ListNamespaces").namespaces}
        assert sorted((n.spec.extra.get("reset"), n.blocks) for n in kept.values()) == [("3", 2), ("4", 2)]  # (one by one)
        (engine,) = daemon.admin("ListEngines").engines
        assert [kept[n].spec.extra["reset"] for n in engine.namespaces] == ["4"]  # (it left each one before)
    finally:
        link.close()


def test_a_call_planned_for_an_earlier_namespace_is_not_sent(link, daemon):
    """A store queued on the link thread when the worker adopts a new namespace (vLLM reset its
    prefix cache: the blocks may hold KV of replaced weights) is not sent into the new namespace."""
    worker, _ = transfers(link, seed=2)
    stuck = threading.Event()
    link.submit(lambda client, ns: stuck.wait(30))
    worker.save([StoreJob("before", [0, 1], chain_hashes("earlier-namespace", 2))])  # queued behind the stuck call
    new_spec = engine_spec()
    new_spec.extra["reset"] = "1"
    worker.configure(new_spec.SerializeToString(deterministic=True))
    stuck.set()
    wait(lambda: worker.stats.store_failures == 2)
    worker.save([StoreJob("after", [2], chain_hashes("new-namespace", 1))])
    wait(lambda: worker.stats.stored_blocks == 1)
    held = [(n.spec.extra.get("reset"), n.blocks) for n in daemon.admin("ListNamespaces").namespaces if n.blocks]
    assert held == [("1", 1)]  # the earlier namespace got none


def test_with_eagle_the_last_block_of_a_hit_is_computed_again(link):
    """Speculative decoding on the target's hidden states (EAGLE, MTP): the draft layers' KV of a
    block's last token was computed with the token after it, which this request may not share with
    the one that stored it. As vLLM does for its own prefix cache, a hit drops its last block."""
    worker, _ = transfers(link, seed=1)
    hashes = chain_hashes("eagle", 4)
    worker.save([StoreJob("seed", list(range(4)), hashes)])
    wait(lambda: worker.stats.stored_blocks == 4)
    plain, eagle = planner_for(link), planner_for(link)
    eagle.drop_last_hit_block = True
    for planner in (plain, eagle):
        assert planner.matched_tokens("r", hashes, 6 * BLOCK_TOKENS, 0, None) == (None, False)
        planner.plan_step([])
        wait(lambda planner=planner: planner.matched_tokens("r", hashes, 6 * BLOCK_TOKENS, 0, None) != (None, False))
    assert plain.matched_tokens("r", hashes, 6 * BLOCK_TOKENS, 0, None) == (4 * BLOCK_TOKENS, True)
    assert eagle.matched_tokens("r", hashes, 6 * BLOCK_TOKENS, 0, None) == (3 * BLOCK_TOKENS, True)
    assert eagle.matched_tokens("r", hashes, 6 * BLOCK_TOKENS, 3 * BLOCK_TOKENS, None) == (0, False)


def test_a_lookup_answer_of_the_wrong_length_is_a_miss_not_a_broken_planner(link):
    """Were the daemon to answer a LookupBatch with too few results, those requests miss; the
    planner goes on answering (it raised on every later call)."""
    planner = planner_for(link)
    hashes = chain_hashes("short", 3)
    answered: Future = Future()
    answered.set_result([3])  # one result for two queries
    planner._requests.update({r: scheduler_module._Request(hashes=hashes) for r in ("a", "b")})
    planner._in_flight.append((["a", "b"], answered))
    assert planner.matched_tokens("a", hashes, 4 * BLOCK_TOKENS, 0, None) == (0, False)
    assert planner.matched_tokens("c", hashes, 4 * BLOCK_TOKENS, 0, None) == (None, False)


def test_calls_stay_within_the_daemons_batch_limit(start_daemon):
    """A step's stores and lookups larger than --max-batch-blocks go in several calls (a long prompt's
    hit is its first max_batch_blocks blocks): one call over the limit was refused, and with it
    every store of the step, or every lookup of the batch."""
    daemon = start_daemon("--pool-size", "64MiB", "--max-batch-blocks", "8")
    link = DaemonLink(daemon.address, "pytest-engine", timeout=10.0, reconnect_interval=0.2)
    link.set_namespace_spec(engine_spec())
    try:
        worker, _ = transfers(link, seed=1)
        hashes = chain_hashes("limit", 20)
        worker.save([StoreJob("a", list(range(12)), hashes[:12]), StoreJob("b", list(range(12, 20)), hashes[12:])])
        wait(lambda: worker.stats.stored_blocks == 20)
        planner = planner_for(link)
        prompts = {
            "long": (hashes, 21 * BLOCK_TOKENS),
            "short": (hashes[:6], 7 * BLOCK_TOKENS),
            "other": (hashes[:3], 4 * BLOCK_TOKENS),
        }
        for req_id, (prefix, tokens) in prompts.items():
            assert planner.matched_tokens(req_id, prefix, tokens, 0, None) == (None, False)
        planner.plan_step([])  # 8 + 6 + 3 hashes: two LookupBatch calls
        wait(lambda: planner.matched_tokens("other", hashes[:3], 4 * BLOCK_TOKENS, 0, None) != (None, False))
        hits = {req_id: planner.matched_tokens(req_id, prefix, tokens, 0, None) for req_id, (prefix, tokens) in prompts.items()}
        assert hits == {"long": (8 * BLOCK_TOKENS, True), "short": (6 * BLOCK_TOKENS, True), "other": (3 * BLOCK_TOKENS, True)}
        assert "request refused" not in daemon.log()
        client = link.submit(lambda client, _: client).result()
        ns = link.submit(lambda _, ns: ns).result()
        with pytest.raises(ValueError, match="pinned lookup_batch"):  # (sent as two calls, a failing second
            client.lookup_batch(ns, [hashes] * 9, pin=True)  # would leave the first's leases unknown)
        assert [r.hit_count for r in client.lookup_batch(ns, [hashes] * 8, pin=True)] == [8] * 8
    finally:
        link.close()


def test_planner_stores_prompt_blocks_only_and_honours_max_offload_tokens(link):
    planner = planner_for(link)
    hashes = chain_hashes("limits", 8)
    planner.matched_tokens("r", hashes[:5], 5 * BLOCK_TOKENS + 3, 0, None)
    plan = planner.plan_step([("r", 3 * BLOCK_TOKENS, hashes[:5], list(range(8)))])
    assert [j.block_ids for j in plan.stores] == [[0, 1, 2]]
    plan = planner.plan_step([("r", 8 * BLOCK_TOKENS, hashes, list(range(8)))])  # decode went on: prompt only
    assert [j.block_ids for j in plan.stores] == [[3, 4]]
    planner.matched_tokens("capped", hashes, 8 * BLOCK_TOKENS + 1, 0, 2 * BLOCK_TOKENS)
    plan = planner.plan_step([("capped", 8 * BLOCK_TOKENS, hashes, list(range(8)))])
    assert [j.block_ids for j in plan.stores] == [[0, 1]]


def test_link_survives_absent_and_restarted_daemon(start_daemon, tmp_path):
    address = f"unix://{tmp_path}/absent.sock"
    link = DaemonLink(address, "pytest", timeout=1.0, reconnect_interval=30.0)
    link.set_namespace_spec(engine_spec())
    started = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        link.submit(lambda client, ns: ns.id).result()
    assert time.monotonic() - started < 2
    assert not link.available  # waiting to retry: callers skip the daemon meanwhile
    link.close()

    daemon = start_daemon("--pool-size", "32MiB")
    link = DaemonLink(daemon.address, "pytest", timeout=1.0, reconnect_interval=0.2)
    link.set_namespace_spec(engine_spec())
    first = link.submit(lambda client, ns: (ns.id, client.state.pool_info.pool_id)).result()
    daemon.stop()
    with pytest.raises(DaemonUnavailable):
        link.submit(lambda client, ns: client.lookup(ns, chain_hashes("x", 1))).result()
    restarted = type(daemon)(daemon.directory, daemon.args).start()
    try:
        time.sleep(0.3)
        second = link.submit(lambda client, ns: (ns.id, client.state.pool_info.pool_id)).result()
        assert second[0] == first[0] and second[1] != first[1]  # same namespace, new pool mapped
        assert link.connects == 2
    finally:
        link.close()
        restarted.stop()


def test_a_refused_register_is_tried_again_once_per_reconnect_interval(start_daemon):
    """A namespace the daemon refuses (here: blocks over a quarter of its pool): every call is a miss,
    and the link does not open a session (and log a warning) for each of them."""
    daemon = start_daemon("--pool-size", "16MiB")
    link = DaemonLink(daemon.address, "pytest", timeout=5.0, reconnect_interval=1.0)
    link.set_namespace_spec(spec(block_bytes=8 << 20))
    try:
        calls, deadline = 0, time.monotonic() + 2.5
        while time.monotonic() < deadline:
            with pytest.raises(DaemonUnavailable):
                link.submit(lambda client, ns: ns.id).result()
            calls += 1
            time.sleep(0.01)
        assert calls > 50 and 1 <= link.connects <= 5  # about one session a second (calls and the watcher)
    finally:
        link.close()


def test_a_load_pinned_before_a_daemon_restart_releases_nothing_in_the_new_daemon(start_daemon):
    """A CPU engine's load is pinned, then the daemon restarts and the link reconnects before the engine
    copies it (a long step). Lease ids count from 1 again in the new daemon: the old load's release
    must not unpin the new load that got the same id."""
    daemon = start_daemon("--pool-size", "32MiB")
    link = DaemonLink(daemon.address, "pytest", timeout=5.0, reconnect_interval=0.1)
    link.set_namespace_spec(engine_spec())
    restarted = None
    try:
        storer, _ = transfers(link, seed=1)
        loader, later_loader = transfers(link, seed=2)[0], transfers(link, seed=3)[0]  # (two engines' worth of loads)
        old, new = chain_hashes("before-restart", 4), chain_hashes("after-restart", 4)
        storer.save([StoreJob("s1", [0, 1, 2, 3], old)])
        wait(lambda: storer.stats.stored_blocks == 4)
        loader.start_loads([LoadJob("A", [4, 5, 6, 7], old)])
        wait(lambda: loader._loads["A"][1].future.done())
        daemon.stop(signal.SIGKILL)
        restarted = type(daemon)(daemon.directory, daemon.args).start()
        wait(lambda: link.submit(lambda client, ns: client.state.pool_info.pool_id).exception() is None)
        storer.save([StoreJob("s2", [8, 9, 10, 11], new)])
        wait(lambda: storer.stats.stored_blocks == 8)
        later_loader.start_loads([LoadJob("B", [12, 13, 14, 15], new)])
        wait(lambda: later_loader._loads["B"][1].future.done())
        a_lease = loader._loads["A"][1].future.result().result.lease_id
        assert a_lease == later_loader._loads["B"][1].future.result().result.lease_id  # (the case this is about)
        assert loader.finished_loads() == ({"A"}, set())  # copied from the old pool (verified); its lease went with it
        link.submit(lambda client, ns: None).result()  # a release, had one been sent, is done
        assert restarted.admin("GetStats").pinned_blocks == 4  # B's blocks are still pinned
        assert drain_loads(later_loader) == ({"B"}, set())
        assert restarted.admin("GetStats").pinned_blocks == 0
    finally:
        link.close()
        if restarted is not None:
            restarted.stop()


@contextlib.contextmanager
def idle_through_a_restart(start_daemon, idle_s: float = 0.0, reconnect_interval: float = 0.2):
    """A connected link (its namespace registered) that makes no call while kvtierd stops, stays
    down `idle_s` and starts again: (the link, the restarted daemon, the first session's id)."""
    daemon = start_daemon("--pool-size", "32MiB")
    link = DaemonLink(daemon.address, "pytest-idle", timeout=1.0, reconnect_interval=reconnect_interval)
    link.set_namespace_spec(engine_spec())
    try:
        first = link.submit(lambda client, ns: client.state.session_id).result()
        daemon.stop()
        time.sleep(idle_s)
        restarted = type(daemon)(daemon.directory, daemon.args).start()
        try:
            yield link, restarted, first
        finally:
            restarted.stop()
    finally:
        link.close()
        link.close()  # (again: nothing more)


def test_an_idle_link_reconnects_by_itself_after_a_restart(start_daemon):
    """No call is made while kvtierd restarts: the link still opens a new session and registers its
    namespace within a few reconnect intervals, so the engine's first requests afterwards find it
    (they are not misses, and its stores are not skipped as sent to a daemon that is down)."""
    with idle_through_a_restart(start_daemon) as (link, restarted, first):
        wait(lambda: any(e.namespaces for e in restarted.admin("ListEngines").engines), timeout=10)
        assert link.connects == 2 and link.available
        assert link.submit(lambda client, ns: client.state.session_id).result() != first
        assert link.connects == 2  # (that call found the session open)


def test_a_call_right_after_a_restart_is_not_skipped_for_the_background_retries(start_daemon):
    """The link is idle while kvtierd is down, retrying in the background. Those retries fail, but they
    do not mark the link down for calls: the first call after the daemon is back connects at once.
    (With retries a second apart, the last one failed less than a second before that call, and the
    next one has most likely not yet reconnected the link by itself.)"""
    with idle_through_a_restart(start_daemon, idle_s=1.5, reconnect_interval=1.0) as (link, _, first):
        assert link.available
        assert link.submit(lambda client, ns: client.state.session_id).result(timeout=10) != first


def test_a_link_closed_after_its_thread_stopped_still_ends_its_session(daemon):
    """vLLM shuts connectors down from a finalizer at interpreter exit, after Python has stopped the
    link's thread: closing then ends the session all the same, without raising."""
    link = DaemonLink(daemon.address, "pytest-exit", timeout=1.0, reconnect_interval=0.2)
    link.set_namespace_spec(engine_spec())
    link.submit(lambda client, ns: ns.id).result()
    link._executor.shutdown()  # as interpreter exit leaves it
    link.close()
    wait(lambda: not daemon.admin("ListEngines").engines, timeout=10)


def resident_pool_bytes(path: str) -> int:
    """How much of the pool file this process has mapped in (its Rss in /proc/self/smaps)."""
    resident, in_pool = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:  # a mapping's first line: its address range, ..., its path
            in_pool = line.endswith(path)
        elif in_pool and line.startswith("Rss:"):
            resident += int(line.split()[1]) * 1024
    return resident


@pytest.mark.parametrize("map_pool", [False, True])
def test_only_engines_that_copy_through_the_pool_map_it_at_start(start_daemon, map_pool):
    """A scheduler, or a GPU worker whose copies the daemon makes, never touches the pool: mapping
    all of a large pool at start cost every such process its page tables and seconds."""
    daemon = start_daemon("--pool-size", "64MiB")
    path = daemon.admin("GetInfo").pool.shm_path
    link = DaemonLink(daemon.address, "pytest-engine", timeout=10.0, reconnect_interval=0.2)
    link.set_namespace_spec(engine_spec())
    try:
        link.connect_soon(map_pool=map_pool)
        wait(lambda: daemon.admin("ListEngines").engines)
        if map_pool:
            wait(lambda: resident_pool_bytes(path) == 64 << 20)
        else:
            assert link.submit(lambda client, ns: client.lookup(ns, chain_hashes("x", 2)).hit_count).result() == 0
            assert resident_pool_bytes(path) == 0
    finally:
        link.close()


def test_a_gpu_worker_refused_cuda_ipc_maps_the_pool_once_registered(start_daemon):
    """A GPU worker copies through the pool only when the daemon refuses its cache (cuda_ipc): the
    pool is then mapped (and registered with CUDA where there is one) right after the registration,
    not inside its first copy call."""
    daemon = start_daemon("--pool-size", "64MiB", "--cuda-register", "false")  # (cuda_ipc refused)
    path = daemon.admin("GetInfo").pool.shm_path
    link = DaemonLink(daemon.address, "pytest-engine", timeout=10.0, reconnect_interval=0.2)
    link.set_cuda_kv(gpu_cache_description())
    link.set_namespace_spec(engine_spec())
    try:
        assert not link.submit(lambda client, ns: ns.cuda_registration).result(timeout=10)
        wait(lambda: resident_pool_bytes(path) == 64 << 20)
    finally:
        link.close()


def gpu_cache_description() -> pb.CudaKVCache:
    """A GPU worker's KV cache as it offers it (a daemon without CUDA refuses it)."""
    allocation = pb.CudaAllocation(ipc_handle=b"x" * 64, size_bytes=1 << 20, ref_counter_handle=b"/torch_1_2_0")
    block_bytes = engine_spec().block_bytes
    cache = pb.CudaKVCache(device_uuid="GPU-0", allocations=[allocation], num_blocks=4, ready_events=[b"e" * 64])
    cache.runs.add(allocation=0, offset=0, block_stride=block_bytes, size_bytes=block_bytes)
    return cache


def test_a_gpu_workers_link_leaves_its_namespace_on_a_reset_too(start_daemon):
    """A GPU worker offers its KV cache again with each new namespace (BlockTransfers.configure: the
    cache, then the spec), and its Register still leaves the namespace before."""
    daemon = start_daemon("--pool-size", "64MiB", "--cuda-register", "false", "--max-namespaces", "2")
    link = DaemonLink(daemon.address, "pytest-engine", timeout=10.0, reconnect_interval=0.2)
    try:
        for reset in range(4):
            new_spec = engine_spec()
            new_spec.extra["reset"] = str(reset)
            link.set_cuda_kv(gpu_cache_description())
            link.set_namespace_spec(new_spec)
            ns = link.submit(lambda client, ns: ns).result(timeout=10)
            (engine,) = daemon.admin("ListEngines").engines
            assert list(engine.namespaces) == [ns.id]
        assert link.connects == 1  # (no Register refused, no session dropped)
    finally:
        link.close()


def test_while_the_daemon_is_paused_requests_miss_at_once(start_daemon):
    """A paused daemon (SIGSTOP) accepts connections and never answers. Once a connect attempt to it
    has timed out, the link counts as down until one succeeds: requests miss at once instead of each
    waiting lookup_wait_s behind the next attempt's timeout. It comes back by itself."""
    daemon = start_daemon("--pool-size", "64MiB")
    link = DaemonLink(daemon.address, "pytest-engine", timeout=1.0, reconnect_interval=0.3)
    link.set_namespace_spec(engine_spec())
    planner = PrefixPlanner(link, BLOCK_TOKENS, engine_spec().SerializeToString(), lookup_wait_s=5.0)
    hashes = chain_hashes("paused", 3)
    sockets_before = sum(1 for fd in Path("/proc/self/fd").iterdir() if fd.resolve().name.startswith("socket:"))
    try:
        link.submit(lambda client, ns: None).result(timeout=10)  # connected
        os.kill(daemon.process.pid, signal.SIGSTOP)
        with contextlib.suppress(DaemonUnavailable):
            link.submit(lambda client, ns: client.lookup(ns, hashes)).result(timeout=10)  # times out: session dropped
        wait(lambda: not link.available, timeout=10)  # a connect attempt failed
        for n in range(8):  # over several reconnect intervals
            assert planner.matched_tokens(f"r{n}", hashes, 4 * BLOCK_TOKENS, 0, None) == (0, False)
            time.sleep(0.25)
        wait(lambda: not link._reconnect_queued.is_set())  # (between two of the watcher's attempts)
        started = time.monotonic()
        with pytest.raises(DaemonUnavailable):  # a call does not try to connect meanwhile: only the watcher
            link.submit(lambda client, ns: None).result(timeout=10)
        assert time.monotonic() - started < 0.5
        for _ in range(10):  # more attempts: each one's socket goes with its attempt, not piling up
            with pytest.raises(ConnectionError):
                KVTierClient(daemon.address, timeout=0.2).connect()
        time.sleep(1.5)  # (an abandoned attempt's socket lives out gRPC's connect timeout: 1 s at least)
        sockets = sum(1 for fd in Path("/proc/self/fd").iterdir() if fd.resolve().name.startswith("socket:"))
        assert sockets <= sockets_before + 3
        os.kill(daemon.process.pid, signal.SIGCONT)
        wait(lambda: link.available, timeout=10)
        assert link.submit(lambda client, ns: client.lookup(ns, hashes).hit_count).result(timeout=10) == 0
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
        link.close()


def test_failed_connects_to_a_daemon_that_never_answers_leave_no_thread_behind(tmp_path):
    """A daemon hung after the connection's handshake never answers Session: each failed attempt
    ends gRPC's thread that feeds the session its requests (they piled up, one per retry)."""
    from concurrent import futures

    hold = threading.Event()

    def session(requests, context):  # what a hung kvtierd does: takes the call, never answers
        hold.wait(30)
        return iter(())

    server = grpc.server(futures.ThreadPoolExecutor(8, thread_name_prefix="hung-daemon"))
    handlers = {"Session": grpc.stream_stream_rpc_method_handler(session)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvtier.v1.KVTier", handlers),))
    server.add_insecure_port(f"unix://{tmp_path}/hung.sock")
    server.start()

    def ours() -> int:  # (this process's threads but the hung server's)
        return sum(not thread.name.startswith("hung-daemon") for thread in threading.enumerate())

    before = ours()
    try:
        for _ in range(5):
            with pytest.raises(ConnectionError):
                KVTierClient(f"unix://{tmp_path}/hung.sock", timeout=0.3).connect()
        wait(lambda: ours() <= before, timeout=5)
    finally:
        hold.set()
        server.stop(0)


def test_a_connect_under_way_is_waited_for_not_taken_as_a_miss(tmp_path):
    """A request that arrives while the link is still connecting is asked again, not answered "miss"."""
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts connections, never answers
    silent.bind(str(tmp_path / "silent.sock"))
    silent.listen()
    link = DaemonLink(f"unix://{tmp_path}/silent.sock", "pytest", timeout=3.0, reconnect_interval=30.0)
    link.set_namespace_spec(engine_spec())
    planner = PrefixPlanner(link, BLOCK_TOKENS, engine_spec().SerializeToString(), lookup_wait_s=30.0)
    hashes = chain_hashes("connecting", 4)
    try:
        link.connect_soon(map_pool=True)
        assert link.available
        assert planner.matched_tokens("r1", hashes, 4 * BLOCK_TOKENS + 1, 0, None) == (None, False)
        planner.plan_step([])  # the lookup queues behind the connect
        wait(lambda: not link.available, timeout=15)  # the attempt timed out: now the link is down
        assert planner.matched_tokens("r1", hashes, 4 * BLOCK_TOKENS + 1, 0, None) == (0, False)
        assert planner.matched_tokens("r2", hashes, 4 * BLOCK_TOKENS + 1, 0, None) == (0, False)
    finally:
        link.close()
        silent.close()


def test_a_request_finished_during_its_load_keeps_its_blocks_until_the_load_is_reported(link):
    worker, _ = transfers(link, seed=1)
    hashes = chain_hashes("abort", 3)
    worker.save([StoreJob("seed", [0, 1, 2], hashes)])
    wait(lambda: worker.stats.stored_blocks == 3)
    planner = planner_for(link)
    assert planner.matched_tokens("r", hashes, 3 * BLOCK_TOKENS + 1, 0, None) == (None, False)
    planner.plan_step([])
    wait(lambda: planner.matched_tokens("r", hashes, 3 * BLOCK_TOKENS + 1, 0, None) != (None, False))
    assert planner.matched_tokens("r", hashes, 3 * BLOCK_TOKENS + 1, 0, None) == (3 * BLOCK_TOKENS, True)
    planner.after_alloc("r", [7, 8, 9], 3 * BLOCK_TOKENS)
    assert planner.finished("r") is True  # aborted while loading: vLLM must not reuse blocks 7-9 yet
    planner.on_transfers({"r"}, set())
    assert planner.finished("r") is False
    assert planner.finished("never-loaded") is False


def test_gpu_engines_free_blocks_at_once_and_fence_those_a_step_writes_afresh(link):
    """GPU engines (the daemon reads the blocks after the step): vLLM frees a finished request's
    blocks at once, stores planned or not (so resetting its prefix cache or sleeping never waits for
    a store). Before a step writes blocks allocated afresh, the store calls still reading any of them
    are withdrawn if not yet sent, else awaited; calls reading other blocks are left alone."""
    planner = PrefixPlanner(link, BLOCK_TOKENS, engine_spec().SerializeToString())
    hashes = chain_hashes("gpu-frees", 4)
    planner.matched_tokens("r", hashes, 4 * BLOCK_TOKENS + 1, 0, None)
    plan = planner.plan_step([("r", 4 * BLOCK_TOKENS, hashes, [0, 1, 2, 3])], fresh_blocks=[0, 1, 2, 3])
    assert [j.req_id for j in plan.stores] == ["r"] and plan.fresh_blocks == [0, 1, 2, 3]
    assert planner.finished("r") is False

    worker, _ = transfers(link, seed=2)
    under_way, release = threading.Event(), threading.Event()
    running = link.submit(lambda client, ns: under_way.set() or release.wait(10))  # a store call in the daemon
    queued = link.submit(lambda client, ns: 1)  # one still waiting for the link thread
    under_way.wait(10)
    in_30_s = time.monotonic_ns() + 30_000_000_000
    worker._gpu_stores = [
        DeviceCall(in_30_s, running, [StoreJob("r", [0, 1], hashes[:2])]),
        DeviceCall(in_30_s, queued, [StoreJob("p", [2, 3], hashes[2:])]),
    ]
    worker.fence({7, 8})  # no store reads them
    assert not queued.cancelled() and not running.done()
    worker.fence({3})
    assert queued.cancelled() and not running.done()  # never sent, so nothing to wait for
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    worker.fence({1})
    assert running.done() and time.monotonic() - started > 0.2  # the daemon had copied first


def device_call(link, due_in: float, outcome: Exception | None = None, gate: threading.Event | None = None) -> DeviceCall:
    """A cuda_ipc copy call on the link thread (as the worker makes them) that ends with `outcome`
    (raised) or succeeds, once `gate` (if any) is set; it checks the deadline it is handed."""
    call = DeviceCall.due_in(due_in)

    def copy(deadline_ns: int) -> int:
        assert deadline_ns == call.deadline_ns
        if gate is not None:
            gate.wait(30)
        if outcome is not None:
            raise outcome
        return 1

    call.future = link.submit(lambda client, ns: call.run(copy, daemon_copies=True))
    return call


BROKEN = DataSocketError(grpc.StatusCode.UNAVAILABLE, "connection reset", answered=False)  # sent: may still copy
REFUSED = DataSocketError(grpc.StatusCode.DEADLINE_EXCEEDED, "could not end by the deadline")  # the daemon's answer
NEVER_SENT = DataSocketError(grpc.StatusCode.UNAVAILABLE, "connection refused", answered=False, sent=False)


def test_a_copy_call_failing_without_the_daemon_being_done_holds_its_blocks_past_its_deadline(link, monkeypatch):
    """A cuda_ipc call that failed here after its request went out (a broken connection, a timeout)
    says nothing of the daemon's copy: the daemon may still start it until the call's deadline, and it
    may land a little later. So the load is reported (and its blocks given back to vLLM) only once the
    deadline and CUDA_ANSWER_GRACE_S have passed. A failure the daemon answered (it answers only once
    its copies are over), a request that never went out, and a success are reported at once."""
    monkeypatch.setattr(worker_module, "CUDA_ANSWER_GRACE_S", 0.5)
    worker, _ = transfers(link, seed=3)
    link.submit(lambda client, ns: None).result(timeout=10)  # connected
    calls = {}
    for req_id, outcome in [("broken", BROKEN), ("refused", REFUSED), ("never-sent", NEVER_SENT), ("loaded", None)]:
        calls[req_id] = device_call(link, 3.0, outcome)
        worker._loads[req_id] = LoadJob(req_id, [0], chain_hashes(req_id, 1)), calls[req_id]
    for call in calls.values():
        wait(call.future.done)
    finished, failed = worker.finished_loads()
    assert finished == {"refused", "never-sent", "loaded"} and failed == {"refused", "never-sent"}
    finished, failed = drain_loads(worker)
    assert finished == failed == {"broken"} and time.monotonic_ns() >= calls["broken"].hold_end_ns


def test_a_load_whose_engine_copy_runs_past_its_hold_keeps_its_blocks_until_the_copy_ends(link, monkeypatch):
    """shm on a GPU: the engine's own copy into the blocks runs on the link thread. Should it run
    past the call's deadline and grace (a GPU crowded for seconds), the load is not reported before
    it has ended: vLLM would hand the blocks to another request while the copy still writes them."""
    monkeypatch.setattr(worker_module, "CUDA_ANSWER_GRACE_S", 0.2)
    worker, _ = transfers(link, seed=6)
    copy_started, copy_may_end = threading.Event(), threading.Event()
    call = DeviceCall.due_in(0.2)

    def load(deadline_ns: int) -> int:
        with call.engine_copy():
            copy_started.set()
            copy_may_end.wait(30)
        return 1

    call.future = link.submit(lambda client, ns: call.run(load, daemon_copies=False))
    worker._loads["slow-copy"] = LoadJob("slow-copy", [0], chain_hashes("slow", 1)), call
    copy_started.wait(10)
    time.sleep((call.hold_end_ns - time.monotonic_ns()) / 1e9 + 0.1)  # past its deadline and grace
    assert worker.finished_loads() == (set(), set())
    copy_may_end.set()
    wait(call.future.done)
    assert worker.finished_loads() == ({"slow-copy"}, set())


def test_a_load_still_waiting_for_the_link_at_its_deadline_is_reported_failed_at_once(link, monkeypatch):
    """A load queued behind a stuck call copies nothing (it is not sent past its deadline), so it is
    given up at its deadline, not held CUDA_ANSWER_GRACE_S longer like a call that went out."""
    monkeypatch.setattr(worker_module, "CUDA_ANSWER_GRACE_S", 30.0)
    worker, _ = transfers(link, seed=7)
    stuck = threading.Event()
    link.submit(lambda client, ns: stuck.wait(30))
    queued = device_call(link, 0.3)
    worker._loads["queued"] = LoadJob("queued", [0], chain_hashes("queued", 1)), queued
    assert worker.finished_loads() == (set(), set())
    time.sleep(0.4)
    assert worker.finished_loads() == ({"queued"}, {"queued"}) and queued.future.cancelled()
    stuck.set()


def test_a_copy_call_is_not_sent_once_its_deadline_has_passed(link):
    """The deadline is fixed when the call is submitted: one that waited for the link thread (behind
    a slow call, a reconnect) past it is not sent, and holds nothing."""
    busy = threading.Event()
    link.submit(lambda client, ns: busy.wait(30))
    late = device_call(link, 0.2)
    time.sleep(0.3)
    busy.set()
    with pytest.raises(worker_module.PastDeadline, match="not sent"):
        late.future.result(timeout=10)
    assert late.settled()


def test_a_fence_waits_until_no_store_holds_the_blocks(link, monkeypatch):
    """vLLM writes blocks allocated afresh once the fence returns. It waits for the stores reading
    them: one that failed without the daemon being done with it until its deadline and the grace
    have passed; one with no answer at all (the link thread stuck) no longer than that either."""
    monkeypatch.setattr(worker_module, "CUDA_ANSWER_GRACE_S", 0.5)
    worker, _ = transfers(link, seed=4)
    link.submit(lambda client, ns: None).result(timeout=10)  # connected
    broken = device_call(link, 2.0, BROKEN)
    wait(broken.future.done)  # failed, and held until 2.5 s
    stuck_gate = threading.Event()
    stuck = device_call(link, 3.0, gate=stuck_gate)  # held until 3.5 s at most
    broken.store_jobs = [StoreJob("finished", [0], chain_hashes("broken", 1))]
    stuck.store_jobs = [StoreJob("preempted", [1], chain_hashes("stuck", 1))]
    worker._gpu_stores = [broken, stuck]
    worker.fence({0})
    assert broken.hold_end_ns <= time.monotonic_ns() < stuck.hold_end_ns
    worker.fence({1})
    assert time.monotonic_ns() >= stuck.hold_end_ns
    stuck_gate.set()


def queued_gpu_stores(link, seed: int, monkeypatch) -> tuple[BlockTransfers, list, threading.Event]:
    """A GPU engine's worker whose store calls wait in the link thread's queue behind a
    stuck call until the returned event is set; `sent` records (block ids, ready event) of each
    store call the link thread runs. The copy those calls make needs a GPU (the GPU tests make it for
    real); what is under test here is which calls run, and the worker's bookkeeping."""
    worker, _ = transfers(link, seed=seed)
    sent = []
    monkeypatch.setattr(worker, "_store_gpu", lambda client, ns, hashes, ids, ready, call: sent.append((ids, ready)) or len(ids))
    stuck = threading.Event()
    link.submit(lambda client, ns: stuck.wait(30))
    return worker, sent, stuck


def test_a_tensor_parallel_ranks_store_calls_and_their_resends_carry_its_rank(daemon, monkeypatch):
    """A GPU worker's store call, and the one a fence sends again without the jobs reading fresh
    blocks, carry the rank's keys (the copy itself needs a GPU: recorded here)."""
    link = DaemonLink(daemon.address, "rank-1", timeout=10.0, reconnect_interval=0.2)
    try:
        worker = BlockTransfers(link, LayerMajorKV(kv_cache(3)), tp_rank=1)
        worker.configure(tp_spec(2).SerializeToString(deterministic=True))
        sent = []
        monkeypatch.setattr(worker, "_store_gpu", lambda client, ns, hashes, ids, ready, call: sent.append(hashes) or len(ids))
        stuck = threading.Event()
        link.submit(lambda client, ns: stuck.wait(30))
        hashes = chain_hashes("rank-keys", 4)
        worker._pending_gpu_stores = 1
        worker._submit_gpu_store([StoreJob("preempted", [0, 1], hashes[:2]), StoreJob("running", [2, 3], hashes[2:])], ready=7)
        worker.fence({0, 1})
        stuck.set()
        wait(lambda: worker._pending_gpu_stores == 0)
        assert sent == [[h + b"\x00\x01" for h in hashes[2:]]]
    finally:
        link.close()


def test_a_fence_withdraws_only_the_jobs_reading_fresh_blocks_from_its_steps_store(link, monkeypatch):
    """A step's store call carries every request of the step. A fence while the call still waits for
    the link withdraws the jobs reading the fresh blocks alone: the call goes again with the others'
    (after the same ready event), and the fence does not wait for it."""
    worker, sent, stuck = queued_gpu_stores(link, 5, monkeypatch)
    hashes = chain_hashes("step", 4)
    worker._pending_gpu_stores = 1  # (as save counts the call)
    worker._submit_gpu_store([StoreJob("finished", [0, 1], hashes[:2]), StoreJob("running", [2, 3], hashes[2:])], ready=7)
    started = time.monotonic()
    worker.fence({1, 9})
    assert time.monotonic() - started < 0.5 and worker.stats.store_skipped_blocks == 2
    stuck.set()
    wait(lambda: worker._pending_gpu_stores == 0)
    assert sent == [([2, 3], 7)] and worker.stats.stored_blocks == 2


def test_a_load_fences_its_blocks_from_stores_still_reading_them(link, monkeypatch):
    """A load writes blocks vLLM allocated afresh for it: a store call still reading one of them is
    withdrawn before the load is sent (its other jobs go again)."""
    worker, sent, stuck = queued_gpu_stores(link, 11, monkeypatch)
    hashes = chain_hashes("load-fence", 2)
    worker._pending_gpu_stores = 1
    worker._submit_gpu_store([StoreJob("finished", [5], hashes[:1]), StoreJob("live", [6], hashes[1:])], ready=2)
    worker.start_loads([LoadJob("new", [5], chain_hashes("elsewhere", 1))])
    stuck.set()
    wait(lambda: worker._pending_gpu_stores == 0)
    assert sent == [([6], 2)]


def test_a_fence_sends_nothing_again_into_a_namespace_adopted_since(link, monkeypatch):
    """A step's store call still queued when the engine adopts a new namespace (vLLM reset its prefix
    cache: the blocks may hold KV of replaced weights): a fence that withdraws it sends none of its
    other jobs again, which would put them into the new namespace."""
    worker, sent, stuck = queued_gpu_stores(link, 10, monkeypatch)
    hashes = chain_hashes("adopted-since", 4)
    worker._pending_gpu_stores = 1
    worker._submit_gpu_store([StoreJob("A", [0, 1], hashes[:2]), StoreJob("B", [2, 3], hashes[2:])], ready=3)
    new_spec = engine_spec()
    new_spec.extra["reset"] = "1"
    worker.configure(new_spec.SerializeToString(deterministic=True))
    worker.fence({0})
    stuck.set()
    wait(lambda: worker._pending_gpu_stores == 0)
    time.sleep(0.2)
    assert sent == [] and worker.stats.store_skipped_blocks == 4


@contextlib.contextmanager
def shared_store_behind_a_stuck_call(daemon, monkeypatch, seed: int, timeout: float):
    """queued_gpu_stores on a link of its own whose calls are due in `timeout` seconds, with one
    step's store call for requests A and B (blocks 0 and 1) queued: (worker, sent, stuck, 4 hashes)."""
    link = DaemonLink(daemon.address, "pytest-engine", timeout=timeout, reconnect_interval=0.2)
    link.set_namespace_spec(engine_spec())
    try:
        worker, sent, stuck = queued_gpu_stores(link, seed, monkeypatch)
        hashes = chain_hashes(f"shared-{seed}", 4)
        worker._pending_gpu_stores = 1
        worker._submit_gpu_store([StoreJob("A", [0], hashes[:1]), StoreJob("B", [1], hashes[1:2])], ready=1)
        yield worker, sent, stuck, hashes
    finally:
        link.close()


def test_a_fence_after_a_shared_store_was_given_up_withdraws_the_requests_later_stores(daemon, monkeypatch):
    """A step's store call for requests A and B waits behind a stuck call past its deadline (given up:
    it holds nothing). A fence of A's blocks, the old one and the one of its next step, neither trips
    over the given-up call nor stops part-way: A's later store, still queued, is withdrawn too, and
    nothing is left counted as pending."""
    with shared_store_behind_a_stuck_call(daemon, monkeypatch, seed=8, timeout=0.3) as (worker, sent, stuck, hashes):
        time.sleep(0.4)  # past that call's deadline
        worker._pending_gpu_stores += 1
        worker._submit_gpu_store([StoreJob("A", [2], hashes[2:3])], ready=2)  # A's next step
        worker.fence({0, 2})
        stuck.set()
        time.sleep(0.3)
        assert sent == [] and worker._pending_gpu_stores == 0 and worker._gpu_stores == []


def test_a_store_given_up_past_its_deadline_is_not_sent_again_by_a_later_fence(daemon, monkeypatch):
    """A step's store for A and B waits behind a stuck call past its deadline and is given up; B has
    a later store under way. A fence of A's block then must not send the given-up store again for
    B: only B's later store goes."""
    with shared_store_behind_a_stuck_call(daemon, monkeypatch, seed=9, timeout=0.6) as (worker, sent, stuck, hashes):
        time.sleep(0.4)
        worker._pending_gpu_stores += 1
        worker._submit_gpu_store([StoreJob("B", [5], hashes[2:3])], ready=2)  # B's next step, due later
        time.sleep(0.3)  # the first call past its deadline, the second not
        worker.fence({0})
        stuck.set()
        wait(lambda: worker._pending_gpu_stores == 0)
        assert sent == [([5], 2)]


def test_a_gpu_cache_that_cannot_be_shared_is_copied_by_the_engine(link):
    """A GPU KV cache whose CUDA IPC export fails (memory cudaIpcGetMemHandle cannot share, such as a
    sleep-mode allocator's): the worker registers without it and keeps the cache (the engine copies,
    over shm), instead of raising into vLLM's step."""

    class UnshareableGpuCache:  # what BlockTransfers asks of engine.gpu_kv.GpuKV here
        block_bytes = engine_spec().block_bytes

        def describe(self):
            raise RuntimeError("pointer does not correspond to a registered memory region")

    worker = BlockTransfers(link, UnshareableGpuCache())
    worker.configure(engine_spec().SerializeToString(deterministic=True))
    assert not worker._disabled and link._cuda_kv is None
    assert link.submit(lambda client, ns: ns.block_bytes).result(timeout=10) == engine_spec().block_bytes


def test_gpu_stores_waiting_for_a_slow_daemon_are_bounded(link):
    """A GPU engine's stores queue on the link while the daemon is slow: past MAX_PENDING_GPU_STORES
    calls a step's stores are skipped, so finished requests do not hold ever more of vLLM's blocks."""

    class GpuCache:  # what BlockTransfers asks of engine.gpu_kv.GpuKV for a store
        block_bytes = engine_spec().block_bytes
        ready = 0

        def describe(self):
            raise RuntimeError("no CUDA here: the engine copies (shm)")

        def record_ready(self):
            self.ready += 1
            return self.ready % 64

    cache = GpuCache()
    worker = BlockTransfers(link, cache)
    worker.configure(engine_spec().SerializeToString(deterministic=True))
    release = threading.Event()
    busy = link.submit(lambda client, ns: release.wait(30))  # the daemon's answer is slow in coming
    for step in range(MAX_PENDING_GPU_STORES + 5):
        worker.save([StoreJob(f"r{step}", [step % 8], chain_hashes(f"slow-{step}", 1))])
    assert cache.ready == MAX_PENDING_GPU_STORES and worker.stats.store_skipped_blocks == 5
    release.set()
    wait(lambda: busy.done() and worker._pending_gpu_stores == 0, timeout=30)  # (each then fails: no to_pool)
    worker.save([StoreJob("after", [0], chain_hashes("after", 1))])
    assert cache.ready == MAX_PENDING_GPU_STORES + 1


def tp_spec(tp_size: int) -> pb.NamespaceSpec:
    """engine_spec for a TP engine: its ranks share the namespace, keys carrying the rank."""
    tp = engine_spec()
    tp.tp_size, tp.hash_bytes = tp_size, key_bytes(tp.hash_bytes, tp_size)
    return tp


def test_tensor_parallel_ranks_share_one_namespace_each_with_its_own_blocks(daemon):
    """The ranks of a TP engine register one namespace (not one each: the daemon's namespace limit
    would otherwise fill TP times sooner) and keep their own shard of every block under the block's
    hash and their rank: each rank of a second engine loads its own rank's bytes."""
    raw = tp_spec(2).SerializeToString(deterministic=True)
    hashes, ids = chain_hashes("shards", 3), [0, 1, 2]
    links = [DaemonLink(daemon.address, f"rank{rank}", timeout=10.0, reconnect_interval=0.2) for rank in range(4)]
    try:
        caches = [kv_cache(70 + rank) for rank in range(2)]
        for rank in range(2):
            writer = BlockTransfers(links[rank], LayerMajorKV(caches[rank]), tp_rank=rank)
            writer.configure(raw)
            writer.save([StoreJob("seed", ids, hashes)])
            wait(lambda writer=writer: writer.stats.stored_blocks == 3)
        (namespace,) = daemon.admin("ListNamespaces").namespaces
        assert namespace.blocks == 6 and namespace.spec.hash_bytes == 34
        for rank in range(2):
            reader_cache = [torch.zeros_like(layer) for layer in caches[rank]]
            reader = BlockTransfers(links[2 + rank], LayerMajorKV(reader_cache), tp_rank=rank)
            reader.configure(raw)
            reader.start_loads([LoadJob("again", [5, 6, 7], hashes)])
            assert drain_loads(reader) == ({"again"}, set())
            for layer, stored in zip(reader_cache, caches[rank], strict=True):
                assert torch.equal(layer[[5, 6, 7]], stored[ids])
    finally:
        for link in links:
            link.close()


def test_a_tensor_parallel_engine_of_one_rank_keys_blocks_by_their_hashes_alone():
    """A TP=1 engine's keys are its vLLM hashes, as before ranks had keys (its cached blocks stay valid)."""
    assert key_bytes(32, 1) == 32 and rank_suffix(engine_spec(), 0) == b""
    assert key_bytes(32, 4) == 34 and rank_suffix(tp_spec(4), 3) == b"\x00\x03"


def test_a_prefix_one_tensor_parallel_rank_lacks_is_stored_again_by_the_request_that_missed(daemon):
    """The lookup asks for rank 0's keys; a rank that skipped (or lost) its copy of the blocks fails
    the load, and the request recomputes them. Its stores put that rank's copy back (rank 0's are
    no-ops), so the next request with the prefix loads on every rank instead of missing for good."""
    tp = tp_spec(2)
    raw = tp.SerializeToString(deterministic=True)
    links = [DaemonLink(daemon.address, f"rank{rank}", timeout=10.0, reconnect_interval=0.2) for rank in range(3)]
    try:
        ranks = []
        for rank in range(2):
            worker = BlockTransfers(links[rank], LayerMajorKV(kv_cache(rank)), tp_rank=rank)
            worker.configure(raw)
            ranks.append(worker)
        links[2].set_namespace_spec(tp)
        planner = PrefixPlanner(links[2], BLOCK_TOKENS, raw, lookup_wait_s=5.0)
        hashes, prompt, block_ids = chain_hashes("tp", 4), 4 * BLOCK_TOKENS + 1, [8, 9, 10, 11, 12]
        ranks[0].save([StoreJob("seed", [0, 1, 2, 3], hashes)])  # rank 1 skipped its store of this step
        wait(lambda: ranks[0].stats.stored_blocks == 4)
        for req_id, rank_1_has_them in (("missed", False), ("hit", True)):
            assert planner.matched_tokens(req_id, hashes, prompt, 0, None) == (None, False)
            planner.plan_step([])
            wait(lambda req_id=req_id: planner.matched_tokens(req_id, hashes, prompt, 0, None) != (None, False))
            assert planner.matched_tokens(req_id, hashes, prompt, 0, None) == (4 * BLOCK_TOKENS, True)
            planner.after_alloc(req_id, block_ids, 4 * BLOCK_TOKENS)
            loads = planner.plan_step([]).loads
            for worker in ranks:
                worker.start_loads(loads)
            outcomes = [drain_loads(worker) for worker in ranks]
            assert outcomes[0] == ({req_id}, set()) and outcomes[1] == ({req_id}, set() if rank_1_has_them else {req_id})
            planner.on_transfers({req_id}, set().union(*(failed for _, failed in outcomes)))
            stores = planner.plan_step([(req_id, prompt, hashes, block_ids)]).stores  # (recomputed, when it failed)
            assert [job.hashes for job in stores] == ([] if rank_1_has_them else [hashes])
            for worker in ranks:
                worker.save(stores)
            wait(lambda: ranks[1].stats.stored_blocks == 4)  # (this request's store, or the one before)
    finally:
        for link in links:
            link.close()
