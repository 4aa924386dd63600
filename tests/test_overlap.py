"""Which collectives of a compiled GPU program run beside kernels (``jaxtron/metrics/overlap.py``), on a scheduled
program written out by hand: an all-to-all of rows whose start and done hold a loop of GEMMs between them, one of
counts with a copy between them, and a ragged all-to-all with nothing between its start and its done."""

from pathlib import Path

import pytest

from jaxtron.metrics import overlap
from jaxtron.metrics.budget import Ceilings, budget

CEILINGS = Ceilings(bf16_flops=1e14, fp8_flops=2e14, attention_flops=5e13, copy_bytes=1e12, launch_s=1e-6)
PROGRAM = (Path(__file__).parent / "fixtures" / "overlap_program.hlo").read_text()
ROWS = 1024 * 1024 * 2  # bytes of the bf16[1024, 1024] rows


def test_each_window_holds_the_kernels_scheduled_between_start_and_done():
    found = {w.name: w for w in overlap.windows(PROGRAM, CEILINGS)}
    assert set(found) == {"%send", "%counts", "%home"}
    # the loop between %send's start and done runs its body (a row fusion, a GEMM) and its condition 4 times
    loop = sum(k.runs * k.seconds for k in budget(PROGRAM, CEILINGS).kernels if k.name in ("%row", "%g", "%lt"))
    assert found["%send"].compute_s == pytest.approx(loop) and found["%send"].gemms == 1
    assert found["%send"].bytes == ROWS and found["%send"].kind == "all-to-all"
    assert found["%send"].devices == tuple(range(8))  # its first replica group
    copy = 2 * ROWS / 1e12  # read and written
    assert found["%counts"].compute_s == pytest.approx(copy) and found["%counts"].gemms == 0
    assert found["%home"].compute_s == 0 and found["%home"].kind == "ragged-all-to-all"


def test_the_summary_counts_exchanges_of_rows_and_the_share_their_windows_hide():
    found = overlap.windows(PROGRAM, CEILINGS)
    # at 1e10 B/s a row exchange takes 210 us; the loop's 4 GEMMs (2 x 256 x 512 x 1024 FLOPs at 1e14) hide 43 us
    # of %send's, %home hides nothing
    s = overlap.summary(found, 1e10)
    ex = s["exchanges"]
    assert (ex["count"], ex["beside_gemms"], ex["beside_compute"], ex["bytes"]) == (2, 1, 1, 2 * ROWS)
    send = next(w for w in found if w.name == "%send")
    assert ex["hidden_share"] == pytest.approx(send.compute_s / (ROWS / 1e10) / 2)
    assert s["all-to-all"]["count"] == 2 and s["ragged-all-to-all"]["beside_compute"] == 0
    # at a bandwidth so high that the loop outlasts every transfer, %send is wholly hidden and %home not at all
    assert overlap.summary(found, 1e15)["exchanges"]["hidden_share"] == pytest.approx(0.5)


def test_the_summary_prices_each_window_at_its_own_links_when_given_them():
    """Exchanges inside a node and across nodes in one program: each at the bandwidth of its links, by its start."""
    found = overlap.windows(PROGRAM, CEILINGS)
    send = next(w for w in found if w.name == "%send")
    ex = overlap.summary(found, {"%send": 1e10, "%home": 1e15, "%counts": 1e10})["exchanges"]
    transfer = ROWS / 1e10 + ROWS / 1e15
    assert ex["transfer_s"] == pytest.approx(transfer)
    assert ex["hidden_share"] == pytest.approx(send.compute_s / transfer)  # %home, quick, is not hidden at all
    assert overlap.summary(found, dict.fromkeys(("%send", "%home", "%counts"), 1e10)) == overlap.summary(found, 1e10)


def test_the_report_prints_each_kind_and_the_exchanges_at_each_bandwidth():
    lines = overlap.text(overlap.report(PROGRAM, CEILINGS, {"NVLink": 1e11, "the network": 1e10}), 0.3).splitlines()
    assert lines[0].startswith("collectives beside compute") and "NVLink's 100 GB/s" in lines[0]
    assert lines[-1].startswith("  MoE exchanges of rows: 1 of 2 beside GEMMs; hidden ")
    assert "at the network's 10 GB/s" in lines[-1] and lines[-1].endswith("(the planner takes 30% as hidden)")


def test_a_named_mesh_group_is_read_in_its_device_order():
    """A group over named mesh axes lists its devices through ``device_ids`` (XLA:GPU names a pipelined layout's
    tensor groups so): over axis_0 of a 4 x 1 x 32 mesh laid out as the [32, 4] iota transposed, device 0's group
    is the 4 devices beside it, not every 32nd."""
    from jaxtron.metrics.collectives import group_devices

    named = "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=32], device_ids=([32,4]T(1,0)) {'axis_0'}, use"
    assert group_devices(named) == [0, 1, 2, 3]
    assert group_devices(named.replace("{'axis_0'}", "{'axis_2'}")) == list(range(0, 128, 4))
    assert group_devices("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to") == [0, 4]
