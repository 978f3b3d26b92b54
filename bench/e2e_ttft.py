"""Time to first token with real vLLM (CPU build), in one run, for seven scenarios:

  a  cold: a prompt the engine never saw
  b  the engine's own prefix-cache hit
  c  after the prefix was evicted from the engine, with kvtierd (it comes back from the daemon)
  d  the same eviction without any connector (recomputed)
  e  engine B (a new process) hitting engine A's prefix through kvtierd
  f  the same through vLLM's ExampleConnector (safetensors files on disk), read from the disk: the
     files are dropped from the page cache (fsync + POSIX_FADV_DONTNEED) before engine B starts
  f' the same again with the files in the page cache (a second engine B right after the first)

Prompt length: connectors serve whole blocks and vLLM always computes the last prompt token itself,
and vLLM's CPU backend uses 128-token blocks. A 2000-token prompt therefore leaves 80 tokens that
every connector (and vLLM's own prefix cache) must compute, and on this CPU that tail takes most of
the time whatever the connector (a GPU engine, with 16-token blocks, computes at most 16). So the
scenarios use 2050-token prompts (16 whole blocks and 2 tokens: each connector serves 2048; the
ExampleConnector matches only prompts whose length minus one is not a multiple of the block size),
and (e), (f) and (f') are measured with 2000-token prompts as well, in the same engines.

The model has 128 KiB of KV per token, as Llama-3-8B in bf16 (16 layers x 8 KV heads x head size 128
x K,V x fp32), so a prompt carries 256 MiB of KV, and a small compute (hidden size 512),
so the CPU prefill stays a few seconds. Each value is the median over ROUNDS prompts of
PROMPT_TOKENS tokens, one request at a time (max_tokens=1, so the request time is the time to first
token). Engines run in vLLM's default multiprocess mode (in-process mode shares one GIL between the
engine's busy loop and the connector's transfer thread, which slows every background copy). Writes
bench/results/e2e_ttft.json and bench/results/e2e_ttft.png. Usage: python bench/e2e_ttft.py [--rounds N]
(`--plot-only` redraws the PNG from the JSON).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from common import RESULTS, pyplot, start_daemon, stop_daemon, write_result  # isort: skip

from kvtier.demo.engines import run_engine  # noqa: E402
from kvtier.demo.tiny_model import make_tiny_llama  # noqa: E402

PROMPT_TOKENS = 2050  # 16 blocks of 128 tokens, and 2 tokens
SEED_PROMPT_TOKENS = 2000  # the seed experiment's length: 15 blocks, and 80 tokens
MODEL = Path.home() / ".cache" / "kvtierd" / "bench-llama-16l-kv128k"
MODEL_SHAPE = {"layers": 16, "hidden": 512, "heads": 8, "kv_heads": 8, "head_dim": 128, "vocab": 2048}
MODEL_TEXT = "Llama architecture, 16 layers, hidden 512, 8 heads / 8 KV heads of size 128, fp32, random weights"
KV_PER_BLOCK = 16 << 20  # one 128-token block of all layers; a prompt takes 17 blocks
SMALL_KV = {"kv_bytes": 40 * KV_PER_BLOCK, "max_model_len": 2560}  # room for two prompts: the fillers push the first out
LARGE_KV = {"kv_bytes": 128 * KV_PER_BLOCK, "max_model_len": 2560}


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> dict:
    rng = random.Random(seed)
    return {"tokens": [rng.randrange(3, 2048) for _ in range(tokens)]}


def ttfts_of(result: dict, phase: int) -> list[float]:
    return [out["seconds"] * 1000 for out in result["phases"][phase]]


def ttfts(result: dict, phase_indices: list[int], request: int = 0) -> list[float]:
    return [result["phases"][i][request]["seconds"] * 1000 for i in phase_indices]


def main() -> None:
    if "--plot-only" in sys.argv:
        saved = json.loads((RESULTS / "e2e_ttft.json").read_text())
        plot({k: v for k, v in saved.items() if k in saved["samples_ms"]}, RESULTS / "e2e_ttft.png")
        return
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    model = make_tiny_llama(MODEL, seed=0, **MODEL_SHAPE)
    work = Path(tempfile.mkdtemp(prefix="kvt-bench-"))
    prompts = [prompt(1000 + i) for i in range(rounds)]
    seed_prompts = [prompt(3000 + i, SEED_PROMPT_TOKENS) for i in range(rounds)]
    cross_phases = [{"prompts": prompts}, {"prompts": seed_prompts}]
    fillers = [prompt(2000 + i) for i in range(2)]
    common = {"max_tokens": 1, "multiprocess": True}

    # a, b: one engine without a connector; every prompt twice
    base = run_engine(work, "ab", model, [{"prompts": prompts}, {"prompts": prompts}], **LARGE_KV, **common)
    cold = [out["seconds"] * 1000 for out in base["phases"][0]]
    local = [out["seconds"] * 1000 for out in base["phases"][1]]

    # c, d: prompt, fillers that evict it, the prompt again (its third phase) in each round
    evict_phases = [phase for p in prompts for phase in ({"prompts": [p]}, {"prompts": fillers}, {"prompts": [p]})]
    again = [3 * i + 2 for i in range(rounds)]
    no_connector = run_engine(work, "d", model, evict_phases, **SMALL_KV, **common)

    daemon = start_daemon("--pool-size", "6GiB", "--log-level", "warning")
    try:
        kvtier = {"connector": {"address": daemon.address}}
        with_kvtierd = run_engine(work, "c", model, evict_phases, **SMALL_KV, **common, **kvtier)
        # e: engine A computes and stores, engine B (a new process) loads
        run_engine(work, "e-a", model, cross_phases, **LARGE_KV, **common, **kvtier)
        cross = run_engine(work, "e-b", model, cross_phases, **LARGE_KV, **common, **kvtier)
        hits = [out["num_cached_tokens"] for phase in cross["phases"] for out in phase]
    finally:
        stop_daemon(daemon)

    # f: vLLM's ExampleConnector, engine A saves to disk, engine B loads
    example = {
        "kv_transfer": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(work / "example-connector")},
        }
    }
    run_engine(work, "f-a", model, cross_phases, **LARGE_KV, **common, **example)
    drop_from_page_cache(work / "example-connector")
    disk = run_engine(work, "f-b", model, cross_phases, **LARGE_KV, **common, **example)
    page_cache = run_engine(work, "f-b2", model, cross_phases, **LARGE_KV, **common, **example)
    example_hits = [out["num_cached_tokens"] for phase in disk["phases"] for out in phase]

    scenarios = {
        "a_cold_ms": cold,
        "b_local_prefix_hit_ms": local,
        "c_after_eviction_kvtierd_ms": ttfts(with_kvtierd, again),
        "d_after_eviction_recompute_ms": ttfts(no_connector, again),
        "e_cross_engine_kvtierd_ms": [out["seconds"] * 1000 for out in cross["phases"][0]],
        "f_cross_engine_example_connector_ms": [out["seconds"] * 1000 for out in disk["phases"][0]],
        "f_cross_engine_example_connector_page_cache_ms": [out["seconds"] * 1000 for out in page_cache["phases"][0]],
    }
    seed_length = {
        "e_cross_engine_kvtierd_ms": ttfts_of(cross, 1),
        "f_cross_engine_example_connector_ms": ttfts_of(disk, 1),
        "f_cross_engine_example_connector_page_cache_ms": ttfts_of(page_cache, 1),
    }
    medians = {name: statistics.median(values) for name, values in scenarios.items()}
    seed_medians = {name: statistics.median(values) for name, values in seed_length.items()}
    result = {
        "prompt_tokens": PROMPT_TOKENS,
        "rounds": rounds,
        "model": MODEL_TEXT,
        "kv_bytes_per_prompt": PROMPT_TOKENS * 128 << 10,
        **medians,
        "kvtierd_vs_recompute": medians["e_cross_engine_kvtierd_ms"] / medians["d_after_eviction_recompute_ms"],
        "kvtierd_vs_example_connector": medians["e_cross_engine_kvtierd_ms"] / medians["f_cross_engine_example_connector_ms"],
        "kvtierd_vs_example_connector_page_cache": medians["e_cross_engine_kvtierd_ms"]
        / medians["f_cross_engine_example_connector_page_cache_ms"],
        "evicted_prefix_kvtierd_vs_recompute": medians["c_after_eviction_kvtierd_ms"] / medians["d_after_eviction_recompute_ms"],
        "cross_engine_cached_tokens": hits,
        "example_connector_cached_tokens": example_hits,
        f"tokens_{SEED_PROMPT_TOKENS}": {
            **seed_medians,
            "kvtierd_vs_example_connector": seed_medians["e_cross_engine_kvtierd_ms"]
            / seed_medians["f_cross_engine_example_connector_ms"],
            "kvtierd_vs_example_connector_page_cache": seed_medians["e_cross_engine_kvtierd_ms"]
            / seed_medians["f_cross_engine_example_connector_page_cache_ms"],
            "samples_ms": seed_length,
        },
        "samples_ms": scenarios,
    }
    command = "python bench/e2e_ttft.py" + (f" --rounds {rounds}" if rounds != 5 else "")
    path = write_result("e2e_ttft", result, command)
    plot(medians, RESULTS / "e2e_ttft.png")
    for key, value in result.items():
        if key not in ("samples_ms", f"tokens_{SEED_PROMPT_TOKENS}"):
            print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    for key, value in result[f"tokens_{SEED_PROMPT_TOKENS}"].items():
        if key != "samples_ms":
            print(f"{SEED_PROMPT_TOKENS}-token prompts, {key}: {value:.3f}")
    print(f"wrote {path}")


def drop_from_page_cache(directory: Path) -> None:
    """Make the next reads of these files come from the disk (no root needed, unlike drop_caches)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plot(medians: dict[str, float], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    labels = [
        "a cold",
        "b local hit",
        "c evicted,\nkvtierd",
        "d evicted,\nrecompute",
        "e engine B\nvia kvtierd",
        "f engine B via\nExampleConnector\n(disk)",
        "f' engine B via\nExampleConnector\n(page cache)",
    ]
    colors = ["#999999", "#666666", "#2a7ab9", "#c0504d", "#2a7ab9", "#e39d3a", "#f2c57c"]
    fig, ax = plt.subplots(figsize=(10.5, 4.5))
    bars = ax.bar(labels, list(medians.values()), color=colors)
    ax.bar_label(bars, fmt="%.0f ms")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, ms (median, log scale)")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(f"vLLM CPU, {PROMPT_TOKENS}-token prompts, one request at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
