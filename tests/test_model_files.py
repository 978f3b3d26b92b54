"""The model directory's fingerprint in the namespace: copies share it, other weights do not."""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from kvtier import model_files
from kvtier.model_files import SAMPLE_BYTES, SAMPLES, WHOLE_FILE_BYTES, files_fingerprint

WEIGHTS = 3 * WHOLE_FILE_BYTES
HEADER = 20_000  # a safetensors header longer than a sample (large models' are)


def model_dir(path, seed: int = 0):
    """A model directory: a config, and a safetensors file (a header, then random bytes; fixed seed)."""
    path.mkdir()
    (path / "config.json").write_text('{"rope_theta": 10000.0, "num_hidden_layers": 2}')
    header = json.dumps({"weight": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}).encode().ljust(HEADER)
    weights = np.random.default_rng(seed).integers(0, 256, WEIGHTS - 8 - HEADER, dtype=np.uint8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", HEADER) + header + weights.tobytes())
    return path


def copy_of(source, target):
    shutil.copytree(source, target, copy_function=shutil.copyfile)  # (no mtimes kept)
    for file in target.iterdir():
        os.utime(file, ns=(1, 1))
    return target


def test_the_same_model_files_copied_at_any_time_give_the_same_fingerprint(tmp_path):
    """Engines that each downloaded the model (other mtimes; with or without a README, a licence or
    git's files) share its namespace."""
    original = model_dir(tmp_path / "a")
    copy = copy_of(original, tmp_path / "b")
    for name in ("README.md", "LICENSE", ".gitattributes"):
        (copy / name).write_text("other text")
    assert files_fingerprint(copy) == files_fingerprint(original)


def test_other_weights_configs_or_files_give_another_fingerprint(tmp_path):
    base = files_fingerprint(model_dir(tmp_path / "base"))
    assert files_fingerprint(model_dir(tmp_path / "other-weights", seed=1)) != base  # same names and sizes

    def changed(name: str, change) -> str:
        directory = copy_of(tmp_path / "base", tmp_path / name)
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

    assert changed("header", flip(HEADER // 2)) != base  # (past the first sample: the header is read whole)
    assert changed("middle", flip((WEIGHTS - SAMPLE_BYTES) * (SAMPLES // 2) // (SAMPLES - 1) + 10)) != base  # sampled
    assert changed("end", flip(WEIGHTS - 1)) != base
    assert changed("config", lambda d: (d / "config.json").write_text('{"rope_theta": 50000.0, "num_hidden_layers": 2}')) != base
    assert changed("renamed", lambda d: (d / "model.safetensors").rename(d / "model-00001.safetensors")) != base
    assert changed("added", lambda d: (d / "tokenizer.json").write_text("{}")) != base


def test_a_model_of_one_file_is_fingerprinted_by_it(tmp_path):
    """A GGUF model is one file: a copy of it (another path, another mtime) shares its fingerprint,
    another file's differs."""

    def gguf(directory: str, seed: int, mtime_ns: int):
        (tmp_path / directory).mkdir()
        path = tmp_path / directory / "model.gguf"
        path.write_bytes(np.random.default_rng(seed).integers(0, 256, WEIGHTS, dtype=np.uint8).tobytes())
        os.utime(path, ns=(mtime_ns, mtime_ns))
        return files_fingerprint(path)

    model = gguf("a", seed=0, mtime_ns=1)
    assert gguf("b", seed=0, mtime_ns=2) == model
    assert gguf("c", seed=1, mtime_ns=1) != model


def test_an_unreadable_file_counts_by_its_name(tmp_path):
    """A file the engine's user cannot read (one vLLM does not load), even behind a symlink into a
    directory it cannot enter (a Hugging Face cache's layout), is fingerprinted by its name, and so
    is a name that is not UTF-8: the cache stays on. (Root reads everything: as root this runs
    without the capabilities that let it, through util-linux's setpriv.)"""
    directory = model_dir(tmp_path / "model")
    unreadable = directory / "optimizer.pt"
    unreadable.write_bytes(b"state")
    unreadable.chmod(0)
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "blob").write_bytes(b"args")
    (tmp_path / "locked").chmod(0)
    (directory / "training_args.bin").symlink_to(tmp_path / "locked" / "blob")
    (directory / os.fsdecode(b"extra-\xff.bin")).write_bytes(b"extra")

    def run(code: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", code]
        if os.getuid() == 0:
            command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *command]
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        return subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment)

    try:
        probe = run(f"open({str(unreadable)!r}).read()")
    except FileNotFoundError:
        pytest.skip("root without util-linux's setpriv: no way to make a file unreadable here")
    if "PermissionError" not in probe.stderr:
        pytest.skip("this root keeps reading every file (no capability to drop)")
    fingerprint = f"import pathlib, kvtier.model_files as m; print(m.files_fingerprint(pathlib.Path({str(directory)!r})))"
    result = run(fingerprint)
    assert result.returncode == 0, result.stderr
    unreadable.unlink()
    without = run(fingerprint)
    assert without.returncode == 0 and without.stdout.strip() != result.stdout.strip()  # (the file counted)
    (tmp_path / "locked").chmod(0o700)


def test_a_huge_weight_file_costs_a_few_reads(tmp_path, monkeypatch):
    """A 64 GiB weight file: its header and SAMPLES pieces are read, nothing more."""
    directory = tmp_path / "huge"
    directory.mkdir()
    with (directory / "model.safetensors").open("wb") as file:
        file.write(struct.pack("<Q", HEADER))
        file.truncate(64 << 30)  # (sparse)
    reads = []
    pread = os.pread
    monkeypatch.setattr(model_files.os, "pread", lambda fd, length, offset: reads.append(length) or pread(fd, length, offset))
    files_fingerprint(directory)
    assert len(reads) <= SAMPLES + 2 and sum(reads) <= SAMPLES * SAMPLE_BYTES + 8 + HEADER + 8
