"""The committed generated modules must match what proto/generate.py produces from the .proto files."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_modules_are_current(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", REPO / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    (tmp_path / "kvtier" / "v1").mkdir(parents=True)
    fresh = generate.generate(tmp_path)
    assert fresh, "nothing generated"
    for path in fresh:
        committed = REPO / "client" / "kvtier" / "v1" / path.name
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `python proto/generate.py`"
