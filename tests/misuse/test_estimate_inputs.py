"""The estimator's inputs: each bad one refused with one ``error:`` line and exit 2 on the
command line, and a ``ValueError`` naming the argument in the API, before anything is printed
or written."""

import dataclasses
import json

import pytest
import torch

import vfsdp
from vfsdp.cli import main
from vfsdp.estimation import hardware, sweep
from vfsdp.estimation.calibrate import calibrate

SHAPES = {"params": [["embed", [1000, 64]], ["layers.0.w", [64, 64]], ["layers.1.w", [64, 64]]]}


@pytest.fixture
def shapes(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(SHAPES))
    return str(path)


def _refused(capsys, argv, match):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), (out, err)
    assert match in err, err


@pytest.mark.parametrize("extra, match", [
    (["--tokens-per-gpu", "0"], "--tokens-per-gpu must be an int >= 1, got 0"),
    (["--tokens-per-gpu", "-5"], "--tokens-per-gpu must be an int >= 1, got -5"),
    (["--global-tokens", "3"], "global_tokens=3 gives no token"),
    (["--top-k", "-2"], "--top-k must be an int >= 1"),
    (["--shard", "0"], "--shard must be an int >= 1"),
    (["--shard", "3"], "shard=3 does not divide 8"),
    (["--ep", "0"], "--ep must be an int >= 1"),
    (["--seq", "0"], "--seq must be an int >= 1"),
    (["--gpus", "8,x"], "--gpus takes ints >= 1, got 'x'"),
    (["--gpus", "0"], "--gpus takes ints >= 1"),
    (["--gpus", ","], "give at least one GPU count"),
    (["--vs", "fsdp3"], "vs names ['fsdp3']"),
    (["--micro-batch-tokens", "0"], "--micro-batch-tokens must be an int >= 1"),
    (["--micro-batch-tokens", "3000"], "micro_batch_tokens=3000 does not divide the 4096"),
    (["--hw", "tpu9"], "neither a profile"),
    (["--float8-saved-weights", "--float8"], "float8_saved_weights=True needs float8=True and compiled"),
    (["--bf16-all-gathers"], "float8_all_gather=False needs float8=True"),
    (["--float8-fused-casts"], "float8_fused_casts=True needs float8=True"),
    (["--float8-recipe", "rowwise"], "float8_recipe='rowwise' needs float8=True"),
    (["--float8-recipe", "blockwise", "--float8"], "unknown float8_recipe 'blockwise'"),
])
def test_the_estimate_command_refuses_bad_options(shapes, capsys, extra, match):
    argv = ["estimate", shapes, "--gpus", "8", *extra]
    if "--gpus" in extra:
        argv = ["estimate", shapes, *extra]
    _refused(capsys, argv, match)


def test_a_profile_with_a_negative_rate_is_refused_naming_the_field(shapes, tmp_path, capsys):
    data = dataclasses.asdict(hardware("h100"))
    for field, value in [("flops", -1), ("inter_bw", 0), ("compute_efficiency", 1.5),
                         ("intra_latency", -1e-6), ("gpus_per_node", 0),
                         ("attention_efficiency", 0), ("contention", -0.5)]:
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps(dict(data, **{field: value})))
        _refused(capsys, ["estimate", shapes, "--gpus", "8", "--hw", str(path)], field)
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(hardware("h100"), **{field: value})


def test_a_non_integer_dimension_is_refused_naming_the_tensor(tmp_path, capsys):
    for dims in ([64.5, 64], [-1, 64], ["a", 64], [True, 4]):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"params": [["layers.0.w", dims]]}))
        _refused(capsys, ["estimate", str(path), "--gpus", "8"], "layers.0.w has dimension")
    path.write_text("{not json")
    _refused(capsys, ["estimate", str(path), "--gpus", "8"], "not JSON")
    path.write_text(json.dumps({"params": [["w"]]}))
    _refused(capsys, ["estimate", str(path), "--gpus", "8"], "expected [name, shape]")


def test_json_into_a_missing_folder_is_made_and_a_folder_is_refused_first(shapes, tmp_path,
                                                                          capsys):
    out = tmp_path / "new" / "deeper" / "rows.json"
    assert main(["estimate", shapes, "--gpus", "8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["gpus"] == 8
    capsys.readouterr()
    _refused(capsys, ["estimate", shapes, "--gpus", "8", "--json", str(tmp_path)], "is a folder")
    (tmp_path / "file").write_text("")
    _refused(capsys, ["estimate", shapes, "--gpus", "8", "--json",
                      str(tmp_path / "file" / "rows.json")], "is a file, not a folder")


@pytest.mark.parametrize("extra, match", [
    (["--tokens", "0"], "--tokens must be an int >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be an int >= 1"),
    (["--world-size", "0"], "--world-size must be an int >= 1"),
])
def test_the_calibrate_command_refuses_bad_options_before_starting(capsys, extra, match):
    _refused(capsys, ["calibrate", *extra], match)


def test_the_api_names_the_argument():
    spec = vfsdp.plan({"layers": [{"w": torch.empty(8, 8, device="meta")}] * 2}, 2)
    tree = {"layers": [{"w": torch.empty(8, 8, device="meta")} for _ in range(2)]}
    for kwargs, match in [({"tokens_per_rank": 0}, "tokens_per_rank"),
                          ({"tokens_per_rank": 2.5}, "tokens_per_rank"),
                          ({"experts_per_token": -2}, "experts_per_token"),
                          ({"seq": 0}, "seq"), ({"rank": 2}, "rank=2"),
                          ({"comm_library_bytes": -1}, "comm_library_bytes"),
                          ({"fused_loss": "yes"}, "fused_loss"),
                          ({"reduce_dtype": "fp32"}, "reduce_dtype"),
                          ({"recompute": "yes"}, "recompute"),
                          ({"padding": "none"}, "unknown padding 'none'"),
                          ({"float8_saved_weights": 1}, "float8_saved_weights must be True"),
                          ({"float8_all_gather": "no", "float8": True},
                           "float8_all_gather must be True"),
                          ({"float8_all_gather": True}, "float8_all_gather=True needs float8=True"),
                          ({"float8_all_gather": False}, "float8_all_gather=False needs float8=True"),
                          ({"float8_fused_casts": True}, "float8_fused_casts=True needs float8=True"),
                          ({"float8_fused_casts": "te", "float8": True},
                           "float8_fused_casts must be True"),
                          ({"float8_recipe": "rowwise"}, "float8_recipe='rowwise' needs float8=True"),
                          ({"float8_recipe": "blockwise", "float8": True},
                           "unknown float8_recipe 'blockwise'"),
                          ({"float8_recipe": "rowwise", "float8": True, "float8_all_gather": True},
                           "float8_all_gather=True needs float8_recipe='tensorwise'"),
                          ({"float8_saved_weights": True, "float8": True},
                           "needs float8=True and compiled=True")]:
        with pytest.raises(ValueError, match=match):
            vfsdp.estimate(spec, **kwargs)
    for kwargs, match in [({"tokens_per_gpu": 0}, "tokens_per_gpu"),
                          ({"tokens_per_gpu": -5}, "tokens_per_gpu"),
                          ({"shard": 0}, "shard"), ({"global_tokens": 0}, "global_tokens"),
                          ({"experts_per_token": -2}, "experts_per_token"),
                          ({"vs": ["fsdp3"]}, "vs"),
                          ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
                          ({"micro_batch_tokens": 3000}, "micro_batch_tokens=3000 does not"),
                          ({"micro_batch_tokens": 1024, "micro_batches": 2}, "not both")]:
        with pytest.raises(ValueError, match=match):
            sweep(tree, [2], **kwargs)
    with pytest.raises(ValueError, match="gpus is empty"):
        sweep(tree, [])
    with pytest.raises(ValueError, match="repeats"):
        calibrate(None, repeats=0)


def test_the_api_refuses_what_is_not_a_plan_or_a_list_of_counts():
    tree = {"layers": [{"w": torch.empty(8, 8, device="meta")} for _ in range(2)]}
    with pytest.raises(TypeError, match="spec must be a ShardSpec"):
        vfsdp.estimate(tree)
    with pytest.raises(ValueError, match="gpus takes a list"):
        sweep(tree, 8)


def test_an_unknown_option_is_refused_in_estimate_s_name():
    spec = vfsdp.plan({"w": torch.empty(8, 8, device="meta")}, 2)
    with pytest.raises(TypeError, match=r"estimate\(\) got an unexpected keyword argument 'bogus'"):
        vfsdp.estimate(spec, bogus=1)
