import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster than two, and far faster when the cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
