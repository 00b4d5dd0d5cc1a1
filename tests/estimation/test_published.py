"""benchmarks/published: every row carries its citation and the figure it quotes, and the
comparison runs."""

import importlib.util
import json
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
FIELDS = {"id", "project", "repo", "commit", "path", "table", "quote", "hw", "model", "gpus",
          "shard", "micro_batch", "grad_accum", "seq", "precision", "compile", "recompute",
          "reduce", "tokens_per_s_per_gpu", "memory_gib", "memory_kind", "notes"}


def _load():
    spec = importlib.util.spec_from_file_location("published", os.path.join(ROOT, "published.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_row_quotes_its_source_and_the_figures_it_records():
    with open(os.path.join(ROOT, "published", "rows.json")) as f:
        rows = json.load(f)["rows"]
    assert len(rows) >= 20 and len({r["project"] for r in rows}) >= 4
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert set(r) == FIELDS, r["id"]
        assert len(r["commit"]) == 40 and r["repo"].count("/") == 1 and r["path"], r["id"]
        tps = r["tokens_per_s_per_gpu"]
        assert f"{tps:,}" in r["quote"] or f"| {tps} |" in r["quote"], r["id"]
        if r["memory_gib"] is not None:
            assert str(r["memory_gib"]) in r["quote"] and r["memory_kind"] == "reserved"
        assert r["precision"] in ("bf16", "float8") and r["recompute"] in (False, "full",
                                                                           "selective")
        assert r["compile"] in (True, False, "blocks") and r["repo"] in _load().SYSTEMS


def test_the_comparison_prints_every_row_and_the_bands(capsys, tmp_path):
    out = tmp_path / "p.json"
    assert _load().main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bf16 tokens/s" in text and "float8 tokens/s" in text and "memory" in text
    records = json.loads(out.read_text())
    assert all(r["predicted_tps"] > 0 for r in records) and len(records) >= 20


def test_the_bf16_rows_the_kernel_model_was_not_fitted_on_hold_the_band():
    # its three fitted numbers (docs/estimate.md) came from llm-foundry's H100 rows and
    # torchtitan's 8-GPU rows: torchtitan's 128-GPU rows and llm-foundry's A100 rows are unseen
    mod = _load()
    with open(mod.ROWS) as f:
        rows = json.load(f)["rows"]
    held = [r for r in rows if r["precision"] == "bf16" and r["hw"] != "h100"
            and r["id"] not in ("tt-8x-eager", "tt-8x-compile")]
    assert len(held) == 7
    for r in held:
        est = mod.predict(r)
        assert abs(est.tokens_per_s / est.gpus / r["tokens_per_s_per_gpu"] - 1) <= 0.15, r["id"]


def test_memory_lands_within_the_band_on_what_each_source_measured():
    # issue 40: at least 80 % of the rows with memory within +-10 % (torchtitan's logs: the
    # peak reserved; FSDP2's stream pools, the loss's peak eager or fused, all from the
    # sources' settings, nothing fitted); every row within +-15 %
    mod = _load()
    with open(mod.ROWS) as f:
        rows = [r for r in json.load(f)["rows"] if r["memory_gib"] is not None]
    assert len(rows) >= 9
    ratios = []
    for r in rows:
        est = mod.predict(r)
        got = est.peak_reserved if r["memory_kind"] == "reserved" else est.peak_allocated
        ratios.append(got / 2**30 / r["memory_gib"])
    assert sum(abs(x - 1) <= 0.10 for x in ratios) >= 0.8 * len(ratios), ratios
    assert all(abs(x - 1) <= 0.15 for x in ratios), ratios
