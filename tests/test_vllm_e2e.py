"""End to end with real vLLM (CPU build) engines, each its own process, sharing prefixes through kvtierd.

Every engine's greedy outputs are compared token for token with a run of the same prompts on an
engine with no connector at all.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from daemon import DaemonProcess, new_daemon_dir, remove_daemon_dir  # noqa: E402
from prompts import BLOCK, prompt, tokens  # noqa: E402

from kvtier.demo.engines import run_engine, start_engine  # noqa: E402
from kvtier.demo.tiny_model import make_tiny_llama  # noqa: E402
from kvtier.pool_view import PoolMapping, decode_page_ids  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent

# Prompts: token ids several blocks long (a block is 128 tokens on the CPU backend).
SHARED = [prompt(tokens(seed, 5 * BLOCK + 40)) for seed in range(3)]
PREFIX = tokens(100, 4 * BLOCK)
BRANCHES = [prompt(PREFIX + tokens(200 + i, BLOCK + 30)) for i in range(3)]
UNIQUE_A = [prompt(tokens(300 + i, 4 * BLOCK + 10)) for i in range(2)]
UNIQUE_B = [prompt(tokens(400 + i, 4 * BLOCK + 10)) for i in range(2)]
FILLERS = [prompt(tokens(500 + i, 5 * BLOCK + 7)) for i in range(4)]
LATE = [prompt(tokens(600 + i, 4 * BLOCK + 50)) for i in range(2)]
ALL = SHARED + BRANCHES + UNIQUE_A + UNIQUE_B + FILLERS + LATE


def key(p: dict) -> tuple[int, ...]:
    return tuple(p["tokens"])


@pytest.fixture(scope="module")
def model() -> Path:
    return make_tiny_llama(REPO / ".models" / "tiny-llama-seed0", seed=0)


@pytest.fixture(scope="module")
def other_model() -> Path:
    return make_tiny_llama(REPO / ".models" / "tiny-llama-seed1", seed=1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def baseline(model, workdir) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of every prompt on an engine without any connector."""
    result = run_engine(workdir, "baseline", model, [{"prompts": ALL}], kv_bytes=128 << 20)
    return {key(p): out["tokens"] for p, out in zip(ALL, result["phases"][0], strict=True)}


@pytest.fixture
def kvtierd():
    daemon = DaemonProcess(new_daemon_dir(), ["--pool-size", "256MiB"]).start()
    yield daemon
    daemon.stop()
    remove_daemon_dir(daemon.directory)


def connector(daemon: DaemonProcess, **extra) -> dict:
    # A generous lookup wait: on a busy 2-core machine a late answer must not turn a hit into a miss.
    return {"address": daemon.address, "lookup_wait_s": 20.0, **extra}


def assert_same_outputs(prompts: list[dict], outputs: list[dict], baseline) -> None:
    for p, out in zip(prompts, outputs, strict=True):
        assert out["finish_reason"] == "length"
        assert out["tokens"] == baseline[key(p)], "output differs from the run without a connector"


def distinct_blocks(prompts: list[dict]) -> int:
    """How many blocks the prompts' full blocks make, a prefix shared between prompts counted once."""
    return len({tuple(p["tokens"][: (i + 1) * BLOCK]) for p in prompts for i in range(len(p["tokens"]) // BLOCK)})


def external_hit_tokens(p: dict) -> int:
    """The most an engine can load for a prompt: its full blocks, leaving the last token to compute."""
    return (len(p["tokens"]) - 1) // BLOCK * BLOCK


def test_engine_b_hits_engine_a_prefix_across_processes(model, workdir, baseline, kvtierd):
    """Case 1 (and 7: B runs in vLLM's multiprocess mode, so plans cross process boundaries)."""
    a = run_engine(workdir, "case1-a", model, [{"prompts": SHARED}], connector=connector(kvtierd))
    assert_same_outputs(SHARED, a["phases"][0], baseline)
    assert all(out["num_cached_tokens"] == 0 for out in a["phases"][0])
    stored = sum(len(p["tokens"]) // BLOCK for p in SHARED)
    assert wait_for_blocks(kvtierd, stored) == stored

    b = run_engine(workdir, "case1-b", model, [{"prompts": SHARED}], connector=connector(kvtierd), multiprocess=True)
    assert_same_outputs(SHARED, b["phases"][0], baseline)
    for p, out in zip(SHARED, b["phases"][0], strict=True):
        assert out["num_cached_tokens"] == external_hit_tokens(p)  # B's own cache was empty: all external
    namespaces = kvtierd.admin("ListNamespaces").namespaces
    assert len(namespaces) == 1 and namespaces[0].spec.num_layers == 4 and namespaces[0].spec.num_kv_heads == 2
    assert kvtierd.admin("GetStats").tiers[0].hits >= sum(external_hit_tokens(p) // BLOCK for p in SHARED)


def test_two_engines_at_once_share_prefixes(model, workdir, baseline, kvtierd):
    """Case 2: engines running at the same time, shared and unique prefixes interleaved."""
    barrier = workdir / "case2-barrier"
    phases_a = [
        {"prompts": [BRANCHES[0], UNIQUE_A[0], UNIQUE_A[1]]},
        {"prompts": [UNIQUE_B[0], BRANCHES[2]], "wait_for": str(barrier)},
    ]
    phases_b = [
        {"prompts": [UNIQUE_B[0], BRANCHES[1], UNIQUE_B[1]]},
        {"prompts": [UNIQUE_A[1], BRANCHES[2]], "wait_for": str(barrier)},
    ]
    a = start_engine(workdir, "case2-a", model, phases_a, connector=connector(kvtierd, engine_name="A"))
    b = start_engine(workdir, "case2-b", model, phases_b, connector=connector(kvtierd, engine_name="B"))
    a.wait_for_line("WAITING 1")
    b.wait_for_line("WAITING 1")
    engines = {e.engine_name: e for e in kvtierd.admin("ListEngines").engines}
    assert {"A", "B"} <= set(engines)
    stored = distinct_blocks(phases_a[0]["prompts"] + phases_b[0]["prompts"])
    assert wait_for_blocks(kvtierd, stored) >= stored  # the last stores of phase 0 landed
    barrier.touch()
    ra, rb = a.result(), b.result()
    for phases, result in ((phases_a, ra), (phases_b, rb)):
        for phase, outputs in zip(phases, result["phases"], strict=True):
            assert_same_outputs(phase["prompts"], outputs, baseline)
    # phase 0: B's branch shares A's 4-block prefix if A stored it first; either engine may win that race
    # phase 1: each engine asks for what only the other one computed
    assert ra["phases"][1][0]["num_cached_tokens"] == external_hit_tokens(UNIQUE_B[0])
    assert rb["phases"][1][0]["num_cached_tokens"] == external_hit_tokens(UNIQUE_A[1])
    assert ra["phases"][1][1]["num_cached_tokens"] >= len(PREFIX)
    assert rb["phases"][1][1]["num_cached_tokens"] >= len(PREFIX)


def test_prefix_evicted_from_the_engine_comes_back_from_kvtierd(model, workdir, baseline, kvtierd):
    """Case 3 (the seed scenario): A, then prompts that push A out of vLLM's KV space, then A again."""
    phases = [{"prompts": [SHARED[0]]}, {"prompts": FILLERS}, {"prompts": [SHARED[0]]}]
    small = {"kv_bytes": 12 * 512 << 10, "max_model_len": 1024}  # 12 blocks of 512 KiB: each filler takes 6
    without = run_engine(workdir, "case3-without", model, phases, **small)
    assert without["phases"][2][0]["num_cached_tokens"] == 0  # evicted: recomputed
    result = run_engine(workdir, "case3-with", model, phases, connector=connector(kvtierd), **small)
    for phase, outputs in zip(phases, result["phases"], strict=True):
        assert_same_outputs(phase["prompts"], outputs, baseline)
    assert result["phases"][2][0]["num_cached_tokens"] == external_hit_tokens(SHARED[0])
    deadline = time.monotonic() + 10  # the engine disconnected when it exited
    while kvtierd.admin("ListEngines").engines:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_after_a_connector_reset_the_engines_blocks_go_to_a_namespace_of_its_own(model, workdir, baseline, kvtierd):
    """RL frameworks replace an engine's weights in place, then call reset_prefix_cache(
    reset_connector=True) (vLLM does too when it pauses or sleeps): the namespace, made from the
    model's files, would hand out KV of the old weights. After the reset the engine's blocks go to
    a namespace of its own: no hit from before it (here the weights stay the same, so one would
    show as cached tokens), and what it computes next is stored there, not in the shared one."""
    barrier = workdir / "reset-go"
    after = {"prompts": [SHARED[1], UNIQUE_A[1]], "reset_prefix_cache": True, "wait_for": str(barrier)}
    phases = [{"prompts": [SHARED[1]]}, {"prompts": FILLERS}, after]
    small = {"kv_bytes": 12 * 512 << 10, "max_model_len": 1024}  # (as in case 3: the fillers push SHARED[1] out)
    engine = start_engine(workdir, "reset", model, phases, connector=connector(kvtierd), **small)
    engine.wait_for_line("WAITING 2")
    before = wait_for_blocks(kvtierd, distinct_blocks([SHARED[1], *FILLERS]))
    barrier.touch()
    result = engine.result()
    assert result["resets"] == [True]
    for phase, outputs in zip(phases, result["phases"], strict=True):
        assert_same_outputs(phase["prompts"], outputs, baseline)
    assert [out["num_cached_tokens"] for out in result["phases"][2]] == [0, 0]  # no hit from kvtierd
    since = distinct_blocks([SHARED[1], UNIQUE_A[1]])
    wait_for_blocks(kvtierd, before + since)
    assert sorted(n.blocks for n in kvtierd.admin("ListNamespaces").namespaces) == sorted([before, since])


def corrupt_every_block(daemon: DaemonProcess) -> int:
    info = daemon.admin("GetInfo")
    pool = PoolMapping(info.pool.shm_path, info.pool.size_bytes, info.pool.page_size)
    corrupted = 0
    for block in daemon.admin("ListBlocks", page_size=10_000).blocks:
        inspected = daemon.admin("InspectBlock", namespace=block.namespace, hash=block.hash)
        pages = decode_page_ids(inspected.page_ids, len(inspected.page_ids) // 4)
        pool.view.pages[pages[0, -1], :64] ^= 0x5A  # scribble on the block's last page
        corrupted += 1
    pool.close()
    return corrupted


def test_corrupt_or_deleted_blocks_are_recomputed(model, workdir, baseline, kvtierd):
    """Case 4: blocks corrupted after they were stored, or deleted between lookup and load."""
    run_engine(workdir, "case4-a", model, [{"prompts": SHARED[:2]}], connector=connector(kvtierd))
    assert corrupt_every_block(kvtierd) > 0
    b = run_engine(workdir, "case4-b", model, [{"prompts": SHARED[:2]}], connector=connector(kvtierd))
    assert_same_outputs(SHARED[:2], b["phases"][0], baseline)
    assert "a block failed its checksum" in (workdir / "case4-b.log").read_text()

    # deleted between lookup and load: the loader waits 3 s, the test clears the cache meanwhile. The
    # engine keeps vLLM's default kv_load_failure_policy ("fail"): the connector makes it recompute.
    kvtierd.admin("Clear", all=True)
    run_engine(workdir, "case4-c", model, [{"prompts": [SHARED[2]]}], connector=connector(kvtierd))
    default_policy = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": connector(kvtierd, debug_load_delay_s=3.0),
    }
    d = start_engine(workdir, "case4-d", model, [{"prompts": [SHARED[2]]}], kv_transfer=default_policy)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(e.hit_blocks for e in kvtierd.admin("ListEngines").engines):
        time.sleep(0.05)
    assert kvtierd.admin("Clear", all=True).deleted_count > 0
    result = d.result()
    assert_same_outputs([SHARED[2]], result["phases"][0], baseline)
    assert "blocks gone since lookup" in d.log() and "kvtier sets it to 'recompute'" in d.log()


def wait_for_blocks(daemon: DaemonProcess, count: int, timeout: float = 30) -> int:
    """Stores land asynchronously after their step: wait for them."""
    deadline = time.monotonic() + timeout
    while (blocks := daemon.admin("GetStats").tiers[0].blocks) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return blocks


def reconnected(daemon: DaemonProcess, sessions: int, timeout: float = 30) -> None:
    """Wait until `sessions` engine sessions (a vLLM engine's scheduler and worker) have registered
    their namespace with this daemon."""
    deadline = time.monotonic() + timeout
    while sum(bool(e.namespaces) for e in daemon.admin("ListEngines").engines) < sessions:
        assert time.monotonic() < deadline, "the engine did not reconnect"
        time.sleep(0.05)


def test_daemon_absent_killed_and_restarted(model, workdir, baseline):
    """Case 5: the engine never fails a request, reconnects by itself, and hits resume after a restart."""
    directory = new_daemon_dir()
    daemon = DaemonProcess(directory, ["--pool-size", "128MiB"])
    flags = [workdir / f"case5-go-{i}" for i in range(4)]
    phases = [
        {"prompts": [UNIQUE_A[0]]},  # no daemon yet
        {"prompts": [SHARED[1]], "wait_for": str(flags[0])},  # daemon up: stores
        {"prompts": [UNIQUE_B[0]], "wait_for": str(flags[1])},  # daemon killed with SIGKILL
        {"prompts": LATE, "wait_for": str(flags[2])},  # daemon restarted: stores again
    ]
    engine = start_engine(workdir, "case5", model, phases, connector=connector(daemon, reconnect_interval_s=0.5))
    try:
        engine.wait_for_line("WAITING 1")
        daemon.start()
        reconnected(daemon, sessions=2)  # by itself: it retries in the background while kvtierd is absent
        flags[0].touch()
        engine.wait_for_line("WAITING 2")
        assert wait_for_blocks(daemon, len(SHARED[1]["tokens"]) // BLOCK) == len(SHARED[1]["tokens"]) // BLOCK
        daemon.stop(sig=signal.SIGKILL)
        flags[1].touch()
        engine.wait_for_line("WAITING 3")
        daemon = DaemonProcess(directory, ["--pool-size", "128MiB"]).start()
        reconnected(daemon, sessions=2)  # by itself, with no request to make meanwhile
        flags[2].touch()
        result = engine.result()
        for phase, outputs in zip(phases, result["phases"], strict=True):
            assert_same_outputs(phase["prompts"], outputs, baseline)
        late_blocks = sum(len(p["tokens"]) // BLOCK for p in LATE)
        assert wait_for_blocks(daemon, late_blocks) == late_blocks
        again = run_engine(workdir, "case5-again", model, [{"prompts": LATE}], connector=connector(daemon))
        assert_same_outputs(LATE, again["phases"][0], baseline)
        assert [o["num_cached_tokens"] for o in again["phases"][0]] == [external_hit_tokens(p) for p in LATE]
    finally:
        engine.process.kill()
        daemon.stop()
        remove_daemon_dir(directory)


def test_no_cross_hits_between_salts_models_or_dtypes(model, other_model, workdir, baseline, kvtierd):
    """Case 6: a cache_salt, another model or another KV dtype never hits another's blocks."""
    run_engine(workdir, "case6-a", model, [{"prompts": SHARED[:1]}], connector=connector(kvtierd))
    salted = [prompt(SHARED[0]["tokens"], cache_salt="tenant-b")]
    b = run_engine(workdir, "case6-salt", model, [{"prompts": salted}, {"prompts": salted}], connector=connector(kvtierd))
    assert b["phases"][0][0]["num_cached_tokens"] == 0
    assert b["phases"][0][0]["tokens"] == baseline[key(SHARED[0])]
    c = run_engine(workdir, "case6-bf16", model, [{"prompts": SHARED[:1]}], connector=connector(kvtierd), dtype="bfloat16")
    assert c["phases"][0][0]["num_cached_tokens"] == 0
    d = run_engine(workdir, "case6-model", other_model, [{"prompts": SHARED[:1]}], connector=connector(kvtierd))
    assert d["phases"][0][0]["num_cached_tokens"] == 0
    namespaces = kvtierd.admin("ListNamespaces").namespaces
    assert len({n.spec.kv_dtype for n in namespaces}) == 2 and len({n.spec.model_id for n in namespaces}) == 2
    assert len(namespaces) == 3
    assert all(ns.tiers[0].hits == 0 for ns in kvtierd.admin("GetStats").namespaces)


def write_lora_adapter(path: Path, model: Path, seed: int, rank: int = 8) -> None:
    """A PEFT LoRA adapter of the model's q and v projections with random weights (a fixed seed)."""
    import json  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    from safetensors.numpy import save_file  # noqa: PLC0415

    config = json.loads((model / "config.json").read_text())
    hidden, head_dim = config["hidden_size"], config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    outputs = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    rng, tensors = np.random.default_rng(seed), {}
    for layer in range(config["num_hidden_layers"]):
        for projection, out in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.3, (rank, hidden)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.3, (out, rank)).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(outputs), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps({**adapter_config, "task_type": "CAUSAL_LM", "lora_dropout": 0.0}))


def test_a_lora_adapter_rewritten_under_its_path_never_gets_the_old_adapters_blocks(model, workdir, kvtierd):
    """vLLM hashes an adapter by its name and path only, and kvtierd's blocks outlive engines: an
    adapter retrained and written over the same path must not load the old one's KV. Engine A
    stores with adapter v1; engine B, with v1 again, hits and gives A's tokens; engine C, with v2
    written over the same path, gets no hit (its output is then its own recompute) and other tokens."""
    adapter = workdir / "lora-adapter"
    lora_prompt = {**SHARED[0], "lora": {"name": "tuned", "id": 1, "path": str(adapter)}}

    def run(name: str) -> dict:
        result = run_engine(workdir, name, model, [{"prompts": [lora_prompt]}], connector=connector(kvtierd), max_lora_rank=8)
        return result["phases"][0][0]

    write_lora_adapter(adapter, model, seed=1)
    a = run("lora-a")
    assert a["num_cached_tokens"] == 0
    stored = len(SHARED[0]["tokens"]) // BLOCK
    assert wait_for_blocks(kvtierd, stored) == stored
    b = run("lora-b")
    assert b["num_cached_tokens"] == external_hit_tokens(SHARED[0]) and b["tokens"] == a["tokens"]
    write_lora_adapter(adapter, model, seed=2)  # retrained, same name and path
    c = run("lora-c")
    assert c["num_cached_tokens"] == 0 and c["tokens"] != a["tokens"]
