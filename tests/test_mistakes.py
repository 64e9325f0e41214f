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


def test_gqa_mapping_and_its_mistake():
    import attnlab
    from attnlab.lessons import mistakes

    assert [mistakes.gqa_kv_head(h, 8, 2) for h in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [mistakes.gqa_kv_head(h, 8, 2, interleaved=True) for h in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8,
                                                                                                      generator=g)
    ref, _ = attnlab.reference(q, k, v)
    assert attnlab.check.compare(mistakes.gqa_attention(q, k, v), ref).passed
    assert not attnlab.check.compare(mistakes.gqa_attention(q, k, v, interleaved=True), ref).passed


def test_reversed_causal_sees_the_future_and_empties_the_last_row():
    import attnlab
    from attnlab.lessons import mistakes

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 5, 4, generator=g) for _ in range(3))
    out = mistakes.reversed_causal(q, k, v)
    assert torch.all(out[0, 0, -1] == 0)
    ref, _ = attnlab.reference(q, k, v, causal=True)
    assert not attnlab.check.compare(out, ref).passed


def test_mha_double_scaling():
    from attnlab.lessons import mistakes

    o = mistakes.mha_double_scaling(N=8)
    want = o["nn.MultiheadAttention"]
    assert torch.allclose(o["attnlab"], want, atol=1e-4)
    assert not torch.allclose(o["attnlab, q pre-scaled"], want, atol=1e-2)


def test_small_n_verdict_reads_whatever_the_csv_holds():
    import pandas as pd

    from attnlab.lessons import perf

    rows = []
    for case, n, (s, t, kern) in (("a", 128, (0.05, 0.10, 0.04)), ("b", 512, (0.08, 0.07, 0.04))):
        for b, ms in (("sdpa-flash", s), ("sdpa-cudnn", s * 2), ("triton", t), ("triton-kernel", kern)):
            rows.append({"case": case, "backend": b, "status": "ok", "ms": ms, "Nk": n, "host_us": 90.0})
    text = perf.small_n_verdict(pd.DataFrame(rows))
    assert "in 1:" in text and "holds only in part" in text
    assert "is not the bare kernel" in text and "90 µs of host time" in text
    assert "kernel itself" not in text  # no claim about kernels from a row that times calls
    assert perf.small_n_verdict(None).startswith("No latency")
