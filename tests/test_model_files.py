"""The model directory's fingerprint in the namespace: copies share it, other weights do not."""

import os
import shutil
import time

import numpy as np

from kvtier.model_files import SAMPLE_BYTES, SAMPLES, WHOLE_FILE_BYTES, files_fingerprint


def model_dir(path, seed: int = 0, weight_bytes: int = 3 * WHOLE_FILE_BYTES):
    """A model directory: a config, and weights of random bytes (fixed seed)."""
    path.mkdir()
    (path / "config.json").write_text('{"rope_theta": 10000.0, "num_hidden_layers": 2}')
    weights = np.random.default_rng(seed).integers(0, 256, weight_bytes, dtype=np.uint8)
    (path / "model.safetensors").write_bytes(weights.tobytes())
    return path


def test_the_same_files_copied_anywhere_at_any_time_give_the_same_fingerprint(tmp_path):
    """Engines that each downloaded the model (other paths, other mtimes) share its namespace."""
    original = model_dir(tmp_path / "a")
    copy = tmp_path / "b"
    shutil.copytree(original, copy, copy_function=shutil.copyfile)  # (no mtimes kept)
    for file in copy.iterdir():
        os.utime(file, ns=(1, 1))
    assert files_fingerprint(copy) == files_fingerprint(original)


def test_other_weights_configs_or_files_give_another_fingerprint(tmp_path):
    base = files_fingerprint(model_dir(tmp_path / "base"))
    assert files_fingerprint(model_dir(tmp_path / "other-weights", seed=1)) != base  # same names and sizes

    def changed(name: str, change) -> str:
        directory = tmp_path / name
        shutil.copytree(tmp_path / "base", directory)
        change(directory)
        return files_fingerprint(directory)

    def flip(offset: int):
        def change(directory):
            with (directory / "model.safetensors").open("r+b") as file:
                file.seek(offset)
                byte = file.read(1)
                file.seek(offset)
                file.write(bytes([byte[0] ^ 1]))

        return change

    size = 3 * WHOLE_FILE_BYTES
    assert changed("header", flip(100)) != base  # (a safetensors header: names, shapes, offsets)
    assert changed("middle", flip((size - SAMPLE_BYTES) * (SAMPLES // 2) // (SAMPLES - 1) + 10)) != base  # (a piece sampled)
    assert changed("end", flip(size - 1)) != base
    assert changed("config", lambda d: (d / "config.json").write_text('{"rope_theta": 50000.0, "num_hidden_layers": 2}')) != base
    assert changed("renamed", lambda d: (d / "model.safetensors").rename(d / "model-00001.safetensors")) != base
    assert changed("added", lambda d: (d / "tokenizer.json").write_text("{}")) != base


def test_a_huge_weight_file_costs_a_few_reads(tmp_path):
    """A sparse 64 GiB file: sampled, not read (reading it whole would take minutes)."""
    directory = tmp_path / "huge"
    directory.mkdir()
    with (directory / "model.safetensors").open("wb") as file:
        file.truncate(64 << 30)
    started = time.monotonic()
    files_fingerprint(directory)
    assert time.monotonic() - started < 2.0, "more than SAMPLES pieces were read"
    assert SAMPLES * SAMPLE_BYTES <= 1 << 20
