"""graphed_step's optimizer preparation and replay checks, host logic on the CPU (meta
tensors stand in for device ones), and the GPU behaviour they protect (skipped without
CUDA)."""

from __future__ import annotations

import pytest
import torch

from fusegnn import GraphedStep, graphed_step
from fusegnn.capture import _make_capturable

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here)")


def test_make_capturable_moves_every_host_scalar_of_the_state():
    """An NAdam that stepped before (not capturable) keeps ``step`` and ``mu_product`` on
    the host; a capturable step needs both on the parameter's device (``mu_product``
    stayed on the host, and the warm-up's capturable NAdam step failed)."""
    p = torch.nn.Parameter(torch.empty(3, device="meta"))
    opt = torch.optim.NAdam([p])
    opt.state[p] = {"step": torch.tensor(2.0), "mu_product": torch.tensor(0.9),
                    "exp_avg": torch.zeros(3, device="meta"), "exp_avg_sq": torch.zeros(3, device="meta")}
    _make_capturable(opt)
    assert opt.param_groups[0]["capturable"] is True and opt.defaults["capturable"] is True
    state = opt.state[p]
    assert {k: v.device.type for k, v in state.items()} == dict.fromkeys(state, "meta")
    assert state["step"].dtype == state["mu_product"].dtype == torch.float32
    # an old-style number step becomes a tensor there
    q = torch.nn.Parameter(torch.empty(2, device="meta"))
    opt = torch.optim.Adam([q])
    opt.state[q] = {"step": 3, "exp_avg": torch.zeros(2, device="meta"), "exp_avg_sq": torch.zeros(2, device="meta")}
    _make_capturable(opt)
    assert opt.state[q]["step"].device.type == "meta" and opt.state[q]["step"].dtype == torch.float32


def _nadam_steps(model, opt, x, y):
    def train_step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return train_step


@requires_cuda
def test_nadam_that_stepped_eagerly_trains_through_replays():
    """Resume-style: NAdam steps eagerly (host ``step`` / ``mu_product``), then the step
    is graphed: the replays train like the same optimizer stepped eagerly."""
    torch.manual_seed(0)
    eager = torch.nn.Linear(8, 4).cuda()
    twin = torch.nn.Linear(8, 4).cuda()
    twin.load_state_dict(eager.state_dict())
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 4, device="cuda")
    opt_e = torch.optim.NAdam(eager.parameters(), lr=0.01)
    opt_t = torch.optim.NAdam(twin.parameters(), lr=0.01)
    step_e, step_t = _nadam_steps(eager, opt_e, x, y), _nadam_steps(twin, opt_t, x, y)
    for _ in range(2):  # eager steps first: host state
        opt_e.zero_grad(set_to_none=True)
        step_e()
        opt_t.zero_grad(set_to_none=True)
        step_t()
    graphed = graphed_step(step_t, opt_t, warmup=2)
    for _ in range(6):
        opt_e.zero_grad(set_to_none=True)
        loss_e, loss_t = step_e().detach(), graphed().clone()
    assert graphed.captured
    torch.testing.assert_close(loss_t, loss_e, rtol=1e-4, atol=1e-6)
    for p_e, p_t in zip(eager.parameters(), twin.parameters()):
        torch.testing.assert_close(p_t, p_e, rtol=1e-4, atol=1e-5)


def _checked_step(optimizer):
    """A GraphedStep's optimizer checks alone, on the CPU (no capture)."""
    step = GraphedStep.__new__(GraphedStep)
    step.optimizers, step._name = (optimizer,), "train_step"
    step._snapshot_optimizers()
    return step


def test_replays_refuse_a_rebound_device_tensor_hyperparameter():
    """A device-tensor learning rate is read at its address by every replay: changed in
    place it takes effect (no error), replaced by another object (``g["lr"] = g["lr"] *
    0.5``, a number) the replays would silently keep the old one, so the next call
    refuses it. Meta tensors stand in for CUDA ones."""
    params = [torch.zeros(3, requires_grad=True)]
    opt = torch.optim.Adam(params, lr=0.01)
    lr = torch.tensor(0.01, device="meta")
    opt.param_groups[0]["lr"] = lr
    step = _checked_step(opt)
    step._check_optimizers()
    lr.fill_(0.005)  # in place, as torch's schedulers do
    step._check_optimizers()
    opt.param_groups[0]["lr"] = lr * 0.5
    with pytest.raises(RuntimeError, match=r"'lr', a meta tensor, was replaced by .* after the step was captured"):
        step._check_optimizers()
    opt.param_groups[0]["lr"] = 0.005
    with pytest.raises(RuntimeError, match=r"'lr', a meta tensor, was replaced by 0.005"):
        step._check_optimizers()
    opt.param_groups[0]["lr"] = lr
    step._check_optimizers()


@requires_cuda
def test_rebinding_a_cuda_learning_rate_after_the_capture_is_refused():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).cuda()
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 4, device="cuda")
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01, device="cuda"), capturable=True)
    graphed = graphed_step(_nadam_steps(model, opt, x, y), opt, warmup=1)
    for _ in range(3):
        graphed()
    assert graphed.captured
    opt.param_groups[0]["lr"].fill_(0.005)  # in place: fine
    graphed()
    opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * 0.5
    with pytest.raises(RuntimeError, match=r"'lr', a cuda tensor, was replaced"):
        graphed()
    graphed.reset()
    for _ in range(3):
        graphed()
    assert graphed.captured
