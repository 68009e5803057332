"""fusegnn.kernels._triton, the one home of the Triton helpers: the one reading of
``TRITON_INTERPRET`` (as Triton itself reads it), the dtype table, and every kernel a
LazyKernel (jitted at its first launch, so the interpreter choice is made then)."""

from __future__ import annotations

import importlib
import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (conftest does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fusegnn.kernels import _triton  # noqa: E402

KERNEL_MODULES = ("block_attention", "edge_softmax", "gat_fused", "gcn_norm", "sddmm", "spmm_gar", "spmm_gas")


@pytest.mark.parametrize("value, enabled", [
    ("1", True), ("true", True), ("TRUE", True), ("on", True), ("yes", True), ("y", True), (" 1 ", True),
    ("0", False), ("", False), ("off", False), ("2", False), ("false", False),
])
def test_interpreter_enabled_reads_the_variable_as_triton_does(monkeypatch, value, enabled):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert _triton.interpreter_enabled() is enabled
    knobs = pytest.importorskip("triton.knobs")
    if value.strip() == value:  # Triton's own reading, where it is defined on this version
        assert bool(knobs.runtime.interpret) is enabled


def test_interpreter_unset_is_off(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not _triton.interpreter_enabled() and not _triton.interpreter_usable()


def test_interpreter_usable_needs_triton_imported_for_it(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_triton, "_triton_interprets", lambda: False)
    assert not _triton.interpreter_usable()
    monkeypatch.setattr(_triton, "_triton_interprets", lambda: True)
    assert _triton.interpreter_usable()


def test_one_dtype_table():
    pytest.importorskip("triton")
    from fusegnn.kernels import block_attention
    from fusegnn.sparse import kernel_backends

    assert block_attention.SUPPORTED_DTYPES == _triton.BLOCK_ATTENTION_DTYPES
    assert set(_triton.BLOCK_ATTENTION_DTYPES) < set(_triton.FLOAT_DTYPES)
    assert kernel_backends.FLOAT_DTYPES is _triton.FLOAT_DTYPES


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_every_kernel_is_a_lazy_kernel(name):
    """No kernel module holds a kernel jitted at import: each is a LazyKernel."""
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    module = importlib.import_module(f"fusegnn.kernels.{name}")
    lazy = [v for v in vars(module).values() if isinstance(v, _triton.LazyKernel)]
    assert lazy, name
    jitted_at_import = [k for k, v in vars(module).items() if isinstance(v, JITFunction) and v.__module__ == module.__name__]
    interpreted = [k for k, v in vars(module).items()
                   if type(v).__name__ == "InterpretedFunction" and getattr(v, "fn", None) is not None
                   and v.fn.__module__ == module.__name__ and k not in _triton._HELPERS.get(module.__name__, {})]
    assert not jitted_at_import and not interpreted, (name, jitted_at_import, interpreted)
