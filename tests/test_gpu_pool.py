"""On a CUDA machine the daemon pins its pool with cudaHostRegister (run on the device machine)."""

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_pool_is_cuda_registered(start_daemon):
    daemon = start_daemon("--pool-size", "512MiB")
    info = daemon.admin("GetInfo")
    assert info.pool.cuda_registered
    assert "cuda_registered=True" in daemon.log()
    assert daemon.stop() == 0  # unregisters and removes the pool cleanly


def test_cuda_register_can_be_turned_off(start_daemon):
    daemon = start_daemon("--pool-size", "64MiB", "--cuda-register", "false")
    assert not daemon.admin("GetInfo").pool.cuda_registered
