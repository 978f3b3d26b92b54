"""The verdict board (kvtier.verdicts, kvtierd.verdict_board): the engine's wait on a slot, as the GPU
writes it (here this test writes the words), and the daemon's slots and sequence numbers. The GPU's
side runs in test_cuda_ipc.py and test_gpu_copy.py."""

from __future__ import annotations

import mmap
import os
import threading
import time

import grpc
import numpy as np
import pytest

from kvtier import verdicts
from kvtier.client import daemon_done_with
from kvtier.cuda_host import CudaHostRegistration
from kvtierd.verdict_board import VerdictBoard as DaemonBoard


@pytest.fixture
def board_file(tmp_path):
    path = tmp_path / "board.verdicts"
    path.write_bytes(bytes(verdicts.BOARD_BYTES))
    fd = os.open(path, os.O_RDWR)
    writable = mmap.mmap(fd, verdicts.BOARD_BYTES)
    os.close(fd)
    return path, np.frombuffer(writable, dtype="<u8")  # (unmapped with its last view)


def wait(board: verdicts.VerdictBoard, seq: int, give_up_s: float = 5.0, alive=lambda: True) -> None:
    now = time.monotonic_ns()
    board.wait(3, seq, now + 1_000_000, now + int(give_up_s * 1e9), alive)


def test_the_engine_waits_past_an_earlier_loads_word_until_its_own_is_written(board_file):
    path, words = board_file
    words[3] = verdicts.word(6, verdicts.OK)  # the slot's previous load
    board = verdicts.VerdictBoard(path)
    writer = threading.Timer(0.05, words.__setitem__, (3, verdicts.word(7, verdicts.OK)))
    start = time.monotonic()
    writer.start()
    wait(board, 7)
    assert time.monotonic() - start >= 0.05
    board.close()


@pytest.mark.parametrize(
    ("written", "code", "done"),
    [
        (verdicts.word(7, verdicts.BAD), grpc.StatusCode.DATA_LOSS, True),  # in place, a checksum differs
        (verdicts.word(8, verdicts.OK), grpc.StatusCode.ABORTED, True),  # the slot went to a later load
        (verdicts.word(6, verdicts.OK), grpc.StatusCode.DEADLINE_EXCEEDED, False),  # never written
    ],
)
def test_what_the_engine_makes_of_a_slot_that_does_not_say_ok(board_file, written, code, done):
    """DATA_LOSS and ABORTED come once the daemon is done with the copy (the blocks may be reused);
    a verdict that never came says nothing of the copy (the blocks stay held until its grace)."""
    path, words = board_file
    words[3] = written
    board = verdicts.VerdictBoard(path)
    with pytest.raises(grpc.RpcError) as failed:
        wait(board, 7, give_up_s=0.1)
    assert failed.value.code() == code and daemon_done_with(failed.value) is done


def test_the_engine_stops_waiting_when_its_session_ends(board_file):
    path, _ = board_file
    board = verdicts.VerdictBoard(path)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as gone:
        wait(board, 7, give_up_s=30, alive=lambda: time.monotonic() - start < 0.1)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE and not daemon_done_with(gone.value)
    assert time.monotonic() - start < 5


def test_the_engine_maps_the_board_read_only(board_file):
    path, _ = board_file
    board = verdicts.VerdictBoard(path)
    with pytest.raises(ValueError, match="read-only"):
        board.words[0] = 1


def test_a_board_cuda_will_not_register_is_not_made(tmp_path):
    """Without CUDA (here) no board: the registration's loads are answered when done."""
    assert DaemonBoard.create(tmp_path / "board.verdicts", 0o640) is None
    assert not list(tmp_path.iterdir())


def test_the_daemon_gives_each_load_in_flight_its_own_slot_and_a_new_seq(tmp_path):
    path = tmp_path / "board.verdicts"
    path.write_bytes(bytes(verdicts.BOARD_BYTES))
    with path.open("r+b") as file:
        mapping = mmap.mmap(file.fileno(), verdicts.BOARD_BYTES)
    board = DaemonBoard(path, mapping, 0, CudaHostRegistration(0, 0))
    taken = [board.take() for _ in range(verdicts.SLOTS)]
    assert len({slot for slot, _ in taken}) == verdicts.SLOTS
    assert [seq for _, seq in taken] == list(range(1, verdicts.SLOTS + 1))
    assert board.take() is None  # every slot in flight
    board.give_back(100)
    assert board.take() == (100, verdicts.SLOTS + 1)
    assert board.status(100, verdicts.SLOTS + 1) == 0  # not written yet
    mapping[800:808] = verdicts.word(verdicts.SLOTS + 1, verdicts.BAD).to_bytes(8, "little")  # as the GPU would
    assert board.status(100, verdicts.SLOTS + 1) == verdicts.BAD and board.status(100, 7) == 0
    board.close()
    assert not path.exists()
