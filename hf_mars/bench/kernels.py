"""A model's linear layers on oneDNN's kernels, for decoding on a CPU (`hf-mars bench --kernels onednn`,
`hf-mars serve --kernels onednn`, the demo's ``1-onednn`` timing).

Why: PyTorch's CPU build sends a float32 matmul to MKL's sgemm, which on some CPUs (measured: an AVX2-only AMD
EPYC, torch 2.13) is slow for the few-row products decoding does, and slower the more rows: a 262,144-row LM head
took 58 / 138 / 154 ms for 1 / 4 / 9 rows, oneDNN's kernels 23 / 43 / 62 ms. A MARS step multiplies several rows
at once, so it gains the most; plain decoding gains too, so both are timed on the same converted model.

How: `torch.utils.mkldnn.to_mkldnn`, torch's own conversion (every ``nn.Linear``, the LM head included, becomes a
module holding its weight in oneDNN's layout). For inference only: the converted weights are buffers, not
parameters, so nothing trains or saves them; a tied LM head gets its own copy (the embedding stays as it is).
"""

from __future__ import annotations

import warnings

import torch

KERNELS = ("default", "onednn")
DENSE_COUNT = "hf_mars_dense_parameters"  # (the attribute `to_onednn` leaves on the model it converts)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN (x86 and most ARM builds do)."""
    return torch.backends.mkldnn.is_available()


def check_onednn(model) -> None:
    """A clear error where the conversion cannot apply: no oneDNN in this build, or a model not on the CPU."""
    if not onednn_available():
        raise ValueError("oneDNN kernels (--kernels onednn): this torch build has no oneDNN "
                         "(torch.backends.mkldnn.is_available() is False).")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"oneDNN kernels (--kernels onednn) are for a model on the CPU; this one is on {device}.")


def to_onednn(model):
    """``model`` with its linear layers on oneDNN's kernels, converted in place (see the module docstring)."""
    check_onednn(model)
    dtype = next(model.parameters()).dtype
    setattr(model, DENSE_COUNT, parameter_count(model))
    with warnings.catch_warnings():  # (torch's module is written in TorchScript: not the user's to act on)
        warnings.filterwarnings("ignore", message=".*torch.jit.script_method.*", category=DeprecationWarning)
        from torch.utils import mkldnn

        return mkldnn.to_mkldnn(model, dtype)


def check_kernels(kernels: str, device: str = "auto") -> None:
    """A clear error before anything loads for a ``--kernels`` choice that cannot apply: an unknown name, or
    oneDNN's kernels asked for with a ``device`` other than the CPU (``"auto"`` is checked on the loaded model,
    `check_onednn`)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}; got {kernels!r}.")
    if kernels == "onednn" and str(device) not in ("auto", "cpu"):
        raise ValueError(f"oneDNN kernels (--kernels onednn) are for a model on the CPU; --device is {device!r}.")


def use_kernels(model, kernels: str):
    """``model`` on the named kernels (`KERNELS`): unchanged for ``"default"``, `to_onednn` for ``"onednn"``.
    The one place a ``--kernels`` choice is applied (`hf-mars bench`, `hf-mars serve`)."""
    check_kernels(kernels)
    return to_onednn(model) if kernels == "onednn" else model


def parameter_count(model) -> int:
    """The model's parameters, as loaded: a converted model's linear weights are no longer parameters, so
    `to_onednn` notes the count it started from."""
    return getattr(model, DENSE_COUNT, None) or sum(p.numel() for p in model.parameters())
