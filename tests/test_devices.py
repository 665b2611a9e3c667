"""horovod_terngrad.operations.devices: the one ``--device auto|cpu|cuda`` decision every example makes (device,
torch.distributed backend, the rank's GPU), on this machine and on a pretended GPU node."""
import pytest
import torch

from horovod_terngrad.operations import devices as D


class FakeHorovod:
    def __init__(self, cuda: bool):
        self._cuda = cuda

    def cuda_built(self):
        return self._cuda


@pytest.fixture
def gpu_node(monkeypatch):
    """torch sees 4 GPUs; torch.cuda.set_device records its argument instead of touching a device."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return chosen


def test_auto_on_this_machine_is_the_cpu_with_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = D.setup_device("auto")
    assert p.device == torch.device("cpu") and p.backend == "gloo" and not p.is_cuda
    assert p.device_ids is None and p.accelerator == "cpu" and p.note == ""
    assert D.resolve_device("cpu").backend == "gloo"


@pytest.mark.parametrize("choice", ["auto", "cuda"])
def test_a_gpu_rank_takes_nccl_and_its_local_gpu(gpu_node, monkeypatch, choice):
    monkeypatch.setenv("LOCAL_RANK", "2")
    p = D.setup_device(choice)
    assert p.device == torch.device("cuda", 2) and p.backend == "nccl" and p.local_rank == 2
    assert p.device_ids == [2] and p.accelerator == "gpu" and p.describe() == "cuda:2 (nccl)"
    assert gpu_node == [torch.device("cuda", 2)]           # made current before any CUDA work


def test_cpu_on_a_gpu_node_stays_on_the_cpu(gpu_node):
    p = D.setup_device("cpu", local_rank=1)
    assert p.device.type == "cpu" and p.backend == "gloo" and gpu_node == []


def test_horovods_local_rank_beats_the_environment(gpu_node, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert D.setup_device("auto", local_rank=3, horovod=FakeHorovod(True)).device == torch.device("cuda", 3)


def test_local_rank_falls_back_to_open_mpi_and_slurm(gpu_node, monkeypatch):
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert D.local_rank_from_env() == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    assert D.local_rank_from_env() == 3
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(D.DeviceError, match="LOCAL_RANK='x' is not a local rank"):
        D.local_rank_from_env()


def test_horovod_without_cuda_keeps_auto_on_the_cpu_and_says_why(gpu_node):
    p = D.setup_device("auto", local_rank=0, horovod=FakeHorovod(False))
    assert p.device.type == "cpu" and p.backend == "gloo" and gpu_node == []
    assert "hvd.cuda_built() is False" in p.note and "setup.sh --cuda" in p.note
    with pytest.raises(D.DeviceError, match=r"--device cuda: this Horovod was built without CUDA"):
        D.resolve_device("cuda", local_rank=0, horovod=FakeHorovod(False))


def test_more_ranks_than_gpus_names_the_local_rank(gpu_node, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(D.DeviceError, match=r"local rank 4 has no GPU of its own: 4 visible.*CUDA_VISIBLE_DEVICES="
                                             r"'0,1,2,3'.*at most 4 ranks per node"):
        D.resolve_device("auto", local_rank=4)


def test_cuda_without_a_gpu_names_the_problem(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(D.DeviceError, match=r"--device cuda: no CUDA device: torch.cuda.is_available\(\) is False"):
        D.resolve_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(D.DeviceError, match="CPU-only build"):
        D.resolve_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(D.DeviceError, match=r"built for CUDA 13.0 but sees no GPU.*CUDA_VISIBLE_DEVICES=''"):
        D.resolve_device("cuda")


def test_unknown_choice_is_refused():
    with pytest.raises(D.DeviceError, match=r"--device 'gpu': expected one of auto, cpu, cuda"):
        D.resolve_device("gpu")


def test_add_device_argument_defaults_to_auto():
    import argparse
    p = argparse.ArgumentParser()
    D.add_device_argument(p)
    assert p.parse_args([]).device == "auto" and p.parse_args(["--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        p.parse_args(["--device", "gpu"])
