"""Block keys of LoRA requests.

vLLM hashes a request's LoRA adapter into its block hashes by the adapter's name and path only.
Within one engine that is one loaded adapter, but kvtierd's blocks outlive engines (and, with the
filesystem tier, restarts): an adapter retrained and written over the same path would load the old
adapter's KV from kvtierd, and give other tokens than recompute. So a LoRA request's keys in kvtierd
are its block hashes each mixed with the fingerprint of its adapter's files (the same as a local
model's, `model_files.files_fingerprint`), taken once per adapter per process, when the scheduler
first sees it (vLLM loads an adapter once, too). A request whose adapter is not a local file or
directory (nothing to fingerprint) is not cached: no lookup, no store.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.model_files import files_fingerprint

_DOMAIN = b"kvtier-lora-block\0"


@dataclass
class AdapterKeys:
    _fingerprints: dict[tuple[str, int, str], bytes | None] = field(default_factory=dict)
    _keys: dict[str, list[bytes]] = field(default_factory=dict)  # per LoRA request: its keys so far

    def keys(self, req_id: str, lora_request, block_hashes: list) -> list | None:
        """The keys of the request's blocks in kvtierd: its block hashes without an adapter, else each
        hash mixed with the adapter's fingerprint (the same length); None for an adapter that cannot
        be fingerprinted."""
        if lora_request is None:
            return block_hashes
        fingerprint = self._fingerprint(lora_request)
        if fingerprint is None:
            return None
        keys = self._keys.setdefault(req_id, [])
        for block_hash in block_hashes[len(keys) :]:  # (a request's hashes only grow: each mixed once)
            raw = bytes(block_hash)
            keys.append(hashlib.shake_256(_DOMAIN + fingerprint + raw).digest(len(raw)))
        return keys

    def forget(self, req_id: str) -> None:
        self._keys.pop(req_id, None)

    def _fingerprint(self, lora_request) -> bytes | None:
        path = str(getattr(lora_request, "lora_path", "") or "")
        adapter = (str(lora_request.lora_name), int(lora_request.lora_int_id), path)
        if adapter not in self._fingerprints:
            found = bool(path) and Path(path).exists()
            self._fingerprints[adapter] = bytes.fromhex(files_fingerprint(Path(path))) if found else None
        return self._fingerprints[adapter]
