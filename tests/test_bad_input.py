"""Every malformed or hostile call gets a precise status and a log line; the daemon keeps serving."""

import re

import grpc
import numpy as np
import pytest
from blocks import chain_hashes, contents, spec

from kvtier import checksum
from kvtier.client import KVTierClient
from kvtier.v1 import kvtier_pb2 as pb


@pytest.fixture(scope="module")
def env():
    import conftest  # noqa: F401  (sys.path set up)
    from daemon import DaemonProcess, new_daemon_dir, remove_daemon_dir

    daemon = DaemonProcess(
        new_daemon_dir(), ["--pool-size", "16MiB", "--max-batch-blocks", "64", "--max-message-size", "1MiB"]
    ).start()
    owner = KVTierClient(daemon.address, engine_name="owner").connect()
    other = KVTierClient(daemon.address, engine_name="other").connect()
    yield daemon, owner, other
    owner.close()
    other.close()
    assert daemon.stop() == 0
    remove_daemon_dir(daemon.directory)


def call(client: KVTierClient, method: str, **fields):
    fields.setdefault("session_id", client.state.session_id)
    request = getattr(pb, f"{method}Request")(**fields)
    return getattr(client._stub, method)(request, timeout=5)


def expect(code: grpc.StatusCode, fn, *args, match: str = "", **kwargs) -> str:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kwargs)
    assert err.value.code() == code, err.value.details()
    assert match in err.value.details()
    return err.value.details()


def test_bad_inputs(env):
    daemon, owner, other = env
    ns = owner.register(spec(block_bytes=10_000))
    other.register(spec(block_bytes=10_000))
    h = chain_hashes("bad", 4)
    cases = [
        # wrong hash length
        (grpc.StatusCode.INVALID_ARGUMENT, "multiple", lambda: call(owner, "Lookup", namespace=ns.id, hashes=b"short")),
        # unknown namespace
        (grpc.StatusCode.NOT_FOUND, "unknown namespace", lambda: call(owner, "Lookup", namespace="nope", hashes=h[0])),
        # unknown session
        (
            grpc.StatusCode.UNAUTHENTICATED,
            "unknown session",
            lambda: call(owner, "Lookup", session_id="forged", namespace=ns.id, hashes=h[0]),
        ),
        # invalid namespace spec
        (grpc.StatusCode.INVALID_ARGUMENT, "block_bytes", lambda: call(owner, "Register", spec=spec(block_bytes=0))),
        # batch too large
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceeds the limit",
            lambda: call(owner, "Lookup", namespace=ns.id, hashes=b"h" * 32 * 65),
        ),
        # message too large (gRPC's own limit)
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "", lambda: call(owner, "Commit", reservation_id=1, data=b"x" * (2 << 20))),
        # commit of something never reserved
        (grpc.StatusCode.NOT_FOUND, "never made", lambda: call(owner, "Commit", reservation_id=987654)),
        # transports
        (
            grpc.StatusCode.NOT_FOUND,
            "cuda registration",
            lambda: call(owner, "Load", namespace=ns.id, hashes=h[0], transport=pb.TRANSPORT_CUDA_IPC),
        ),
        (
            grpc.StatusCode.NOT_FOUND,
            "cuda registration",
            lambda: call(owner, "Reserve", namespace=ns.id, hashes=h[0], transport=pb.TRANSPORT_CUDA_IPC),
        ),
        (grpc.StatusCode.INVALID_ARGUMENT, "transport", lambda: call(owner, "Load", namespace=ns.id, hashes=h[0])),
        # release of an unknown lease
        (grpc.StatusCode.NOT_FOUND, "lease", lambda: call(owner, "Release", lease_id=424242)),
        # more hashes in all the queries of a batch than 16 times the limit
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "1088 hashes in all exceed the limit of 1024",
            lambda: call(owner, "LookupBatch", namespace=ns.id, queries=[b"h" * 32 * 64] * 17),
        ),
        # more leases in one release than the batch limit (each unknown one is a refusal to build)
        (grpc.StatusCode.INVALID_ARGUMENT, "exceed", lambda: call(owner, "Release", more_lease_ids=[424242] * 65)),
    ]
    for code, match, fn in cases:
        expect(code, fn, match=match)

    reservation = owner.reserve(ns, h[:2])
    # block sizes that do not match the namespace
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        call,
        owner,
        "Commit",
        reservation_id=reservation.id,
        data=b"x" * 19_999,
        match="need exactly",
    )
    # writes beyond a reserved extent
    expect(
        grpc.StatusCode.OUT_OF_RANGE,
        call,
        owner,
        "Write",
        reservation_id=reservation.id,
        index=0,
        offset=9_000,
        data=b"x" * 1_001,
        match="beyond",
    )
    expect(
        grpc.StatusCode.OUT_OF_RANGE,
        call,
        owner,
        "Write",
        reservation_id=reservation.id,
        index=2,
        offset=0,
        data=b"x",
        match="outside",
    )
    # another session's reservation
    expect(grpc.StatusCode.PERMISSION_DENIED, call, other, "Commit", reservation_id=reservation.id, match="another session")
    expect(grpc.StatusCode.PERMISSION_DENIED, call, other, "Abort", reservation_id=reservation.id, match="another session")
    expect(
        grpc.StatusCode.PERMISSION_DENIED,
        call,
        other,
        "Write",
        reservation_id=reservation.id,
        index=0,
        data=b"x",
        match="another session",
    )
    # double commit
    assert owner.commit(reservation.id, contents(h[:2], 10_000).tobytes()) == 2
    expect(grpc.StatusCode.FAILED_PRECONDITION, owner.commit, reservation.id, match="already committed")
    # another session's lease
    lease = owner.lookup(ns, h[:2], pin=True)
    expect(grpc.StatusCode.PERMISSION_DENIED, call, other, "Release", lease_id=lease.lease_id, match="another session")
    owner.release(lease.lease_id)
    # a namespace this session never registered
    unregistered = KVTierClient(daemon.address).connect()
    expect(
        grpc.StatusCode.FAILED_PRECONDITION, call, unregistered, "Lookup", namespace=ns.id, hashes=h[0], match="not registered"
    )
    unregistered.close()
    # an inline load larger than the message limit
    big = owner.register(spec(block_bytes=20_000))
    many = chain_hashes("big", 60)
    owner.store(big, many, contents(many, 20_000))
    inline = {"namespace": big.id, "hashes": b"".join(many), "transport": pb.TRANSPORT_INLINE}  # (the client library splits)
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED, call, owner, "Load", **inline, match="message limit")
    assert daemon.admin("GetStats").pinned_blocks == 0  # the refused load left no pin behind
    assert daemon.admin("GetStats", namespace=big.id).tiers[0].loaded_blocks == 0  # nor counted as loaded

    # The daemon logged each refusal and still serves correct data.
    log = daemon.log()
    for code in (
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "UNAUTHENTICATED",
        "OUT_OF_RANGE",
        "PERMISSION_DENIED",
        "FAILED_PRECONDITION",
    ):
        assert "request refused method=" in log and f"code={code}" in log, code
    assert np.array_equal(owner.load(ns, h[:2]), contents(h[:2], 10_000))
    assert daemon.process.poll() is None


def test_session_must_start_with_hello(env):
    daemon, owner, _ = env
    responses = owner._stub.Session(iter([pb.SessionRequest(heartbeat=pb.Heartbeat())]), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        next(responses)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_admin_bad_inputs(env):
    daemon, owner, _ = env
    ns = owner.register(spec(block_bytes=10_000))
    for method, fields, code in [
        ("InspectBlock", {"namespace": ns.id, "hash": b"\0" * 32}, grpc.StatusCode.NOT_FOUND),
        ("InspectBlock", {"namespace": ns.id, "hash": b"\0" * 3}, grpc.StatusCode.INVALID_ARGUMENT),
        ("ListBlocks", {"page_token": "-5"}, grpc.StatusCode.INVALID_ARGUMENT),
        ("ListBlocks", {"page_token": "abc"}, grpc.StatusCode.INVALID_ARGUMENT),
        ("ListBlocks", {"page_token": "²"}, grpc.StatusCode.INVALID_ARGUMENT),  # a digit to isdigit(), not to int()
        ("ListBlocks", {"page_token": "١٢"}, grpc.StatusCode.INVALID_ARGUMENT),  # Arabic-Indic digits
        ("ListBlocks", {"page_token": "1" * 5000}, grpc.StatusCode.INVALID_ARGUMENT),  # past int()'s 4300 digits
        ("ListBlocks", {"page_size": 100_000}, grpc.StatusCode.INVALID_ARGUMENT),
        ("Clear", {}, grpc.StatusCode.INVALID_ARGUMENT),
        ("Clear", {"namespace": "missing"}, grpc.StatusCode.NOT_FOUND),
        ("DeleteBlocks", {"namespace": ns.id, "hashes": b"abc"}, grpc.StatusCode.INVALID_ARGUMENT),
        ("GetStats", {"namespace": "missing"}, grpc.StatusCode.NOT_FOUND),
    ]:
        expect(code, daemon.admin, method, **fields)


@pytest.mark.parametrize("service, method", [("KVTier", "Lookup"), ("KVTierAdmin", "ListBlocks")])
def test_a_request_that_does_not_parse_is_invalid_argument_logged_and_counted(env, service, method):
    """gRPC's own parse failure answers UNKNOWN, with only a gRPC traceback in the log; the daemon's
    handlers get it instead and refuse it like any bad input."""
    daemon, _, _ = env
    with grpc.insecure_channel(daemon.address) as channel:
        raw = channel.unary_unary(f"/kvtier.v1.{service}/{method}")  # bytes in, bytes out
        details = expect(grpc.StatusCode.INVALID_ARGUMENT, raw, b"\x0a\x05ab", timeout=5, match=f"malformed {method} request")
    assert re.search(rf"request refused method={method} code=INVALID_ARGUMENT reason=malformed", daemon.log()), details


def test_a_hello_with_an_overlong_engine_name_is_refused(env):
    daemon, _, _ = env
    with pytest.raises(ConnectionError, match="INVALID_ARGUMENT.*limited to 256 characters"):
        KVTierClient(daemon.address, engine_name="e" * 257, timeout=5).connect()
    with KVTierClient(daemon.address, engine_name="e" * 256, timeout=5):
        pass
    assert "session refused reason=Hello's engine_name" in daemon.log()


@pytest.mark.parametrize(
    ("code", "method", "fields"),
    [
        (grpc.StatusCode.NOT_FOUND, "Lookup", {"namespace": "n" * 20_000}),
        (grpc.StatusCode.UNAUTHENTICATED, "Lookup", {"session_id": "s" * 20_000}),
        (grpc.StatusCode.NOT_FOUND, "GetStats", {"namespace": "n" * 20_000}),
        (grpc.StatusCode.INVALID_ARGUMENT, "ListBlocks", {"page_token": "t" * 20_000}),
    ],
)
def test_a_refusal_repeating_a_huge_value_keeps_its_status_and_a_short_message(env, code, method, fields):
    """A refusal's message names what the client sent (an unknown id, a bad token): of a value of
    20,000 characters it is clipped, so the status reaches the client (gRPC clients refuse metadata
    over 16 KiB, and the call failed with RESOURCE_EXHAUSTED instead) and the log line stays short."""
    daemon, owner, _ = env
    if method in ("GetStats", "ListBlocks"):
        details = expect(code, daemon.admin, method, **fields)
    else:
        details = expect(code, call, owner, method, **{"namespace": "0" * 32, **fields})
    assert len(details) < 1100 and details.endswith("more characters)")
    assert max(map(len, daemon.log().splitlines())) < 3000


def test_commit_checks_the_checksums_given_with_its_data(env):
    """Commit with data and checksums: checksums of the wrong size are refused as without data
    (they were ignored), and checksums that the data do not match are DATA_LOSS (damaged on the way),
    nothing committed; matching ones (or 0, no checksum, for a block) commit."""
    _, owner, _ = env
    ns = owner.register(spec(block_bytes=4096))
    hashes = chain_hashes("commit-with-checksums", 2)
    data = contents(hashes, 4096)
    sums = checksum.block_checksums(data)
    for bad, code, match in [
        (b"x" * 7, grpc.StatusCode.INVALID_ARGUMENT, "2 blocks need 16"),
        (checksum.encode(sums[:1]), grpc.StatusCode.INVALID_ARGUMENT, "2 blocks need 16"),
        (checksum.encode(sums[::-1]), grpc.StatusCode.DATA_LOSS, "2 of 2 blocks' data do not match"),
    ]:
        reservation = owner.reserve(ns, hashes)
        commit = {"reservation_id": reservation.id, "data": data.tobytes(), "checksums": bad}
        expect(code, call, owner, "Commit", **commit, match=match)
        owner.abort(reservation.id)
    reservation = owner.reserve(ns, hashes)
    given = checksum.encode([sums[0], 0])
    assert call(owner, "Commit", reservation_id=reservation.id, data=data.tobytes(), checksums=given).committed_count == 2
    assert np.array_equal(owner.load(ns, hashes), data)
