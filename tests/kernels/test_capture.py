import pytest
import torch

from quantkit.kernels.capture import capturing, graph_warmup


def test_graph_warmup_marks_calls_as_graphed_and_resets():
    cpu = torch.device("cpu")
    assert not capturing(cpu)
    with graph_warmup():
        assert capturing(cpu)
        with graph_warmup():
            assert capturing(cpu)
        assert capturing(cpu)  # the inner block restores the outer state
    assert not capturing(cpu)
    with pytest.raises(RuntimeError), graph_warmup():
        raise RuntimeError("a forward that failed")
    assert not capturing(cpu)
