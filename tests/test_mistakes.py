"""attnlab.mistakes: the emulated b/h launch bug is caught by the checker exactly when B > 1 and H > 1."""

import torch

import attnlab
from attnlab import check
from attnlab.lessons import mistakes


def _run(B, H, swapped):
    g = torch.Generator().manual_seed(B * 10 + H)
    q, k, v = (torch.randn(B, H, 9, 8, generator=g) for _ in range(3))
    kv_len = [9 - b for b in range(B)]
    ref, _ = attnlab.reference(q, k, v, kv_len=kv_len)
    return check.compare(mistakes.grid_attention(q, k, v, kv_len=kv_len, swapped=swapped), ref).passed


def test_correct_grid_passes_and_swapped_grid_fails():
    assert _run(2, 3, swapped=False)
    assert not _run(2, 3, swapped=True)
    assert not _run(3, 3, swapped=True)


def test_swap_is_invisible_with_one_batch_or_one_head():
    assert _run(1, 4, swapped=True)
    assert _run(4, 1, swapped=True)


def test_launch_table():
    t = mistakes.launch_table(2, 3)
    assert list(t["reads, correct"]) == list(t["stores (b, h)"])
    assert t["reads, swapped"].iloc[1] == (1, 0)
