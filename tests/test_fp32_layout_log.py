import pytest

from attnlab.lessons import kernel_notes


def test_fp32_layout_log_parses_ratios_and_bank_conflicts(tmp_path):
    p = tmp_path / "log.txt"
    p.write_text("case B8 H16 N2048: attnlab triton 5.9 ms err 1e-06 ratio 0.367\n"
                 "case B8 H16 N2048: attnlab triton 5.8 ms err 1e-06 ratio 0.400\n"
                 "## run 2, ncu: var0\n"
                 "    l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum     25\n"
                 "    l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum     1,00\n")
    r = kernel_notes.fp32_layout_log(p)
    assert r["query_major_ratio"] == {"B8 H16 N2048": 0.367}  # the first run's figure
    assert r["bank_conflict_frac"] == 0.25
    with pytest.raises(FileNotFoundError):  # a missing log fails loudly (a wheel install without ATTNLAB_DATA_DIR)
        kernel_notes.fp32_layout_log(tmp_path / "none.txt")
