import pytest
from blocks import spec

from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.errors import InvalidArgument
from kvtierd.namespace import namespace_digest, validate_spec


def test_identical_specs_share_a_namespace():
    assert namespace_digest(spec()) == namespace_digest(spec())


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"tokens_per_block": 32},
        {"kv_dtype": "float16"},
        {"layout": "HND"},
        {"num_layers": 5},
        {"num_kv_heads": 4},
        {"head_size": 128},
        {"block_bytes": 4096},
        {"chunk_bytes": [96 * 1024]},
        {"tp_size": 2},
        {"hash_algorithm": "sha256_cbor"},
        {"hash_seed": "seed-2"},
        {"hash_bytes": 16},
        {"extra": {"cache_layout_version": "2"}},
    ],
)
def test_any_difference_is_another_namespace(change):
    assert namespace_digest(spec(**change)) != namespace_digest(spec())


def test_the_ranks_of_one_tensor_parallel_engine_have_namespaces_of_their_own():
    assert namespace_digest(spec(tp_size=4, tp_rank=1)) != namespace_digest(spec(tp_size=4, tp_rank=0))


def test_every_spec_field_is_in_the_digest():
    base = spec(tp_size=4)
    for field in base.DESCRIPTOR.fields:
        changed = pb.NamespaceSpec()
        changed.CopyFrom(base)
        value = getattr(changed, field.name)
        if field.message_type is not None:  # the map `extra`
            value["changed"] = "1"
        elif field.is_repeated:
            value.append(12345)
        elif field.type == field.TYPE_STRING:
            setattr(changed, field.name, value + "-changed")
        else:
            setattr(changed, field.name, value + 1)
        assert namespace_digest(changed) != namespace_digest(base), field.name


def test_specs_without_the_later_fields_keep_their_ids():
    """Ids of specs that leave out fields added later (pp_size, pp_rank) are what they were before
    those fields existed (computed with the code of 905e075): the fs tier's directories of an
    upgraded daemon stay valid."""
    assert namespace_digest(spec()) == "7898bd2ab4b551c183e0624758e79a4b"
    assert namespace_digest(spec(tp_size=2, tp_rank=1, extra={"a": "b"})) == "994715081b488b6761259441013f8daf"


def test_format_version_changes_the_digest(monkeypatch):
    import kvtierd.namespace as namespace

    before = namespace_digest(spec())
    monkeypatch.setattr(namespace, "NAMESPACE_FORMAT_VERSION", namespace.NAMESPACE_FORMAT_VERSION + 1)
    assert namespace.namespace_digest(spec()) != before


@pytest.mark.parametrize(
    "bad",
    [
        {"model_id": ""},
        {"block_bytes": 0},
        {"hash_bytes": 0},
        {"hash_bytes": 65},
        {"tokens_per_block": 0},
        {"chunk_bytes": [1, 2]},
        {"tp_size": 2, "tp_rank": 2},
        {"pp_size": 2, "pp_rank": 2},
        {"block_bytes": 1 << 40},
        {"model_id": "m" * 9000},  # (every spec goes into GetStats and ListNamespaces answers)
    ],
)
def test_invalid_specs_are_refused(bad):
    with pytest.raises(InvalidArgument):
        validate_spec(spec(**bad), pool_size=1 << 30)
