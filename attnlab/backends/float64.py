"""Backend ``reference``: the float64 reference of :mod:`attnlab.reference`, cast back to the input dtype."""

from __future__ import annotations

import torch

from attnlab.backends import Backend
from attnlab.problem import Problem
from attnlab.reference import reference_forward


class ReferenceBackend(Backend):
    """Backend ``reference``: the float64 reference, cast back to the input dtype."""

    name = "reference"
    takes = "every problem, computed in float64 (float64 inputs too); packed sequences padded; float8_e4m3fn"
    takes_fp8 = True
    description = "float64 math on the inputs' device, chunked over queries (at most ~256 MiB of scores)"

    def forward(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        o, l = reference_forward(prob)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)
