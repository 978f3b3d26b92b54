"""Runs one real vLLM engine (CPU) in its own process, for the demo and the end-to-end tests.

    python -m kvtier.demo.engine_process SPEC.json RESULT.json

SPEC: {"model", "dtype", "kv_bytes", "max_tokens", "connector": null | {kvtier extra config},
       "kv_transfer": null | {KVTransferConfig arguments, for other connectors},
       "multiprocess": bool, "block_size": int | null, "max_lora_rank": int | null (LoRA enabled),
       "phases": [{"prompts": [{"tokens": [...], "cache_salt": str | null,
                                "lora": null | {"name", "id", "path"}}], "wait_for": path | null,
                   "reset_prefix_cache": bool}]}
Before each phase with "wait_for", it prints "WAITING <i>" and waits for that file to exist; before
one with "reset_prefix_cache", it resets vLLM's prefix cache and the connector's (as after a weight
update). After each phase it prints "PHASE <i> DONE". RESULT gets, per phase and prompt: output
tokens, num_cached_tokens and the time of the generate call; and what each reset returned.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if spec.get("multiprocess") else "0")
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    transfer = KVTransferConfig(**spec["kv_transfer"]) if spec.get("kv_transfer") else None
    if spec.get("connector") is not None:
        transfer = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    extra = {"block_size": spec["block_size"]} if spec.get("block_size") else {}
    if spec.get("max_lora_rank"):
        extra.update(enable_lora=True, max_lora_rank=spec["max_lora_rank"], max_loras=1)
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 4096),
        enforce_eager=True,
        kv_cache_memory_bytes=spec.get("kv_bytes", 64 << 20),
        seed=0,
        kv_transfer_config=transfer,
        **extra,
    )
    result = {"startup_s": time.perf_counter() - started, "phases": [], "resets": []}
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True, detokenize=False)
    for index, phase in enumerate(spec["phases"]):
        if phase.get("wait_for"):
            print(f"WAITING {index}", flush=True)
            while not os.path.exists(phase["wait_for"]):
                time.sleep(0.05)
        if phase.get("reset_prefix_cache"):
            result["resets"].append(llm.reset_prefix_cache(reset_connector=True))
        outputs = []
        for prompt in phase["prompts"]:  # one at a time: per-request timings and cache effects in order
            fields = {"prompt_token_ids": prompt["tokens"]}
            if prompt.get("cache_salt"):
                fields["cache_salt"] = prompt["cache_salt"]
            lora = None
            if prompt.get("lora"):
                from vllm.lora.request import LoRARequest  # noqa: PLC0415

                lora = LoRARequest(prompt["lora"]["name"], prompt["lora"]["id"], prompt["lora"]["path"])
            begun = time.perf_counter()
            out = llm.generate([TokensPrompt(**fields)], params, use_tqdm=False, lora_request=lora)[0]
            outputs.append(
                {
                    "tokens": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens or 0,
                    "seconds": time.perf_counter() - begun,
                    "finish_reason": out.outputs[0].finish_reason,
                }
            )
        result["phases"].append(outputs)
        with open(result_path, "w") as f:
            json.dump(result, f)
        print(f"PHASE {index} DONE", flush=True)
    del llm


if __name__ == "__main__":  # the CPU platform spawns processes: keep the entry point guarded
    main(sys.argv[1], sys.argv[2])
