"""A LoRA request's block keys carry its adapter's files (kvtier.engine.adapter_keys)."""

from __future__ import annotations

from dataclasses import dataclass

from blocks import chain_hashes

from kvtier.engine.adapter_keys import AdapterKeys


@dataclass(frozen=True)
class Lora:  # the fields of vLLM's LoRARequest that count
    lora_name: str
    lora_int_id: int
    lora_path: str


def test_keys_follow_the_adapters_files_not_its_name_and_path(tmp_path):
    hashes = chain_hashes("adapter-keys", 6)
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "adapter_model.safetensors").write_bytes(b"weights one")
    lora = Lora("tuned", 1, str(tmp_path / "v1"))

    assert AdapterKeys().keys("plain", None, hashes) is hashes  # no adapter: vLLM's hashes as they are
    first = AdapterKeys().keys("r", lora, hashes)
    assert [len(k) for k in first] == [len(h) for h in hashes] and not set(first) & set(hashes)
    grown = AdapterKeys()
    assert grown.keys("r", lora, hashes[:2]) == first[:2]  # a request's hashes grow: each mixed once
    assert grown.keys("r", lora, hashes) == first

    (tmp_path / "v1" / "adapter_model.safetensors").write_bytes(b"weights two")  # retrained over the same path
    assert AdapterKeys().keys("r", lora, hashes) != first
    assert grown.keys("other", lora, hashes) == first  # (an engine fingerprints an adapter once, as vLLM loads it once)

    assert AdapterKeys().keys("r", Lora("hub", 2, "org/adapter-on-the-hub"), hashes) is None  # nothing to fingerprint
    grown.forget("r")
    assert "r" not in grown._keys
