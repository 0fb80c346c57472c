"""The chi-square helper the sampling tests rely on: rare cells pooled, lossy counts caught."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import chi_square_p_value


def test_a_rare_cell_hit_once_does_not_fail_a_correct_sampler():
    probs = torch.tensor([0.5, 0.49999, 1e-5])
    assert chi_square_p_value(torch.tensor([750.0, 749.0, 1.0]), probs) > 0.05


def test_a_shifted_distribution_still_fails():
    probs = torch.tensor([0.5, 0.3, 0.2, 1e-4])
    assert chi_square_p_value(torch.tensor([600.0, 250.0, 150.0, 0.0]), probs) < 1e-3


def test_too_few_samples_for_two_cells_is_an_error():
    with pytest.raises(AssertionError, match="too few samples"):
        chi_square_p_value(torch.tensor([2.0, 1.0]), torch.tensor([0.6, 0.4]))
