"""The launch module (dflashkit/launch.py): the launcher's environment read once, the device and dtype defaults,
and the process group: NCCL for a GPU, gloo for the CPU, one timeout, joined only with several processes."""

import socket

import pytest
import torch
import torch.distributed as dist

from dflashkit import launch
from dflashkit.errors import UserError

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def alone(monkeypatch):
    """A process started without a launcher."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_process_started_alone_is_rank_0_of_1(alone):
    assert launch.ranks() == (0, 1, 0)
    alone.setenv("WORLD_SIZE", "")  # set but empty, as some schedulers leave it
    assert launch.ranks() == launch.Ranks(rank=0, world_size=1, local_rank=0)


def test_the_launchers_variables_give_rank_world_and_local_rank(alone):
    alone.setenv("RANK", "5")
    alone.setenv("WORLD_SIZE", "8")
    alone.setenv("LOCAL_RANK", "1")
    assert launch.ranks() == (5, 8, 1)


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "two"), ("LOCAL_RANK", "-1"), ("RANK", "8")])
def test_a_bad_launch_variable_is_one_line_naming_it(alone, name, value):
    alone.setenv("WORLD_SIZE", "8")
    alone.setenv(name, value)
    with pytest.raises(UserError, match=f"environment variable {name}=") as error:
        launch.ranks()
    assert "\n" not in str(error.value)


def test_the_local_device_is_the_users_else_this_ranks_gpu_else_the_cpu(alone):
    alone.setenv("LOCAL_RANK", "3")
    assert launch.local_device("cpu") == torch.device("cpu")
    assert launch.local_device("cuda:1") == torch.device("cuda", 1)  # an index the user gave is kept
    assert launch.local_device("cuda") == torch.device("cuda", 3)  # a bare cuda: this rank's GPU
    alone.setattr(torch.cuda, "is_available", lambda: True)
    assert launch.local_device() == torch.device("cuda", 3)
    alone.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.local_device() == torch.device("cpu")


def test_the_default_dtype_is_bf16_on_a_gpu_and_fp32_on_the_cpu():
    assert launch.default_dtype("cuda:0") == torch.bfloat16
    assert launch.default_dtype(torch.device("cpu")) == torch.float32
    assert launch.default_dtype("cpu", "bfloat16") == torch.bfloat16  # the user's choice wins
    assert launch.default_dtype("cuda:0", torch.float16) == torch.float16
    with pytest.raises(UserError, match="dtype 'int8': use one of bfloat16, float16, float32"):
        launch.default_dtype("cpu", "int8")


def test_alone_no_group_is_joined_and_barrier_and_leave_do_nothing(alone):
    assert launch.join_process_group("cpu") is False
    assert not dist.is_initialized()
    launch.barrier()
    launch.leave_process_group()


class _Calls:
    """Stands in for a torch function: records its arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def test_on_a_gpu_the_group_is_nccl_on_this_ranks_device_with_the_one_timeout(alone):
    alone.setenv("WORLD_SIZE", "2")
    init, set_device = _Calls(), _Calls()
    alone.setattr(dist, "init_process_group", init)
    alone.setattr(torch.cuda, "set_device", set_device)
    assert launch.join_process_group("cuda:1") is True
    assert set_device.calls == [((torch.device("cuda", 1),), {})]
    assert init.calls == [(("nccl",), {"timeout": launch.GROUP_TIMEOUT})]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_gloo_group_is_joined_once_waited_on_and_left(alone):
    """A real group of this one process (the environment says one process; ``ranks`` is told two, so that
    ``join_process_group`` joins)."""
    alone.setenv("MASTER_ADDR", "127.0.0.1")
    alone.setenv("MASTER_PORT", str(_free_port()))
    alone.setenv("RANK", "0")
    alone.setenv("WORLD_SIZE", "1")
    alone.setattr(launch, "ranks", lambda: launch.Ranks(0, 2, 0))
    try:
        assert launch.join_process_group("cpu") is True
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert launch.join_process_group("cpu") is True  # joined already: nothing new
        launch.barrier()
    finally:
        launch.leave_process_group()
    assert not dist.is_initialized()
