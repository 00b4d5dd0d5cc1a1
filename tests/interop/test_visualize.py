"""vfsdp.visualize: the layout as text and as a figure, from a spec or from shards."""

import pytest
import torch

import vfsdp
from vfsdp.testing import simulate

PARAMS = {"w": torch.ones(6, 4), "b": torch.ones(5)}


def test_text_shows_each_ranks_share_and_the_padding_between_tensors():
    spec = vfsdp.plan(PARAMS, 2, granularity=vfsdp.rows(1))
    text = vfsdp.visualize(spec, width=24)
    assert text.splitlines() == [
        "unit <root>: 2 tensors, 2 ranks x S=16 float32, padding 3 elements",
        "|AAAA..BBBBBB|BBBBBBBBBBBB|",
        "    rank 0       rank 1",
        "  A b (5,): r0:5",
        "  B w (6, 4): r0:8 r1:16",
        "  . padding"]


def test_shards_and_a_unit_by_name():
    params = {"layers": [{"w": torch.ones(4, 4)} for _ in range(2)]}
    spec = vfsdp.plan(params, 2)

    def body():
        shards = vfsdp.shard(params, spec)
        return vfsdp.visualize(shards, unit="layers.1")

    text = simulate(2, body)[0]
    assert text.startswith("unit layers.1:") and "layers.0" not in text
    assert vfsdp.visualize(spec, unit=("layers", 1)) == text
    with pytest.raises(ValueError, match=r"no unit 'nope'; the units are \['layers.0', 'layers.1'\]"):
        vfsdp.visualize(spec, unit="nope")
    with pytest.raises(TypeError, match="give a ShardSpec"):
        vfsdp.visualize({"w": torch.ones(2)})


def test_figure_draws_one_bar_piece_per_tensor_share_and_padding():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    spec = vfsdp.plan(PARAMS, 2, granularity=vfsdp.rows(1))
    fig = vfsdp.visualize(spec, figure=True)
    ax = fig.axes[0]
    # rank 0: b, padding, w; rank 1: w
    assert len(ax.patches) == 4
    assert [t.get_text() for t in ax.get_yticklabels()] == ["<root> r0", "<root> r1"]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {
        "<root>: b", "<root>: w", "padding"}


def test_max_ranks_draws_the_first_ranks_only():
    spec = vfsdp.plan(PARAMS, 2, granularity=vfsdp.rows(1))
    text = vfsdp.visualize(spec, width=24, max_ranks=1).splitlines()
    assert text[1:3] == ["|AAAAAAAA....BBBBBBBBBBBB|", "          rank 0 (first 1 of 2 ranks)"]
    assert text[4] == "  B w (6, 4): r0:8 r1:16"  # the shares still list every rank
    with pytest.raises(ValueError, match="max_ranks must be at least 1, got 0"):
        vfsdp.visualize(spec, max_ranks=0)
    pytest.importorskip("matplotlib")
    fig = vfsdp.visualize(spec, figure=True, max_ranks=1)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["<root> r0"]
