"""benchmarks/published: every row carries its citation and the figure it quotes, the held-out
rows are flagged and dated, and the comparison runs."""

import importlib.util
import json
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
FIELDS = {"id", "project", "repo", "commit", "path", "table", "quote", "hw", "model", "gpus",
          "shard", "micro_batch", "grad_accum", "seq", "precision", "compile", "recompute",
          "reduce", "tokens_per_s_per_gpu", "memory_gib", "memory_kind", "notes", "held_out"}
# settings only some sources need (published.predict), a throughput quoted for all GPUs or as
# a step's seconds, a memory quoted in decimal GB, a web address (a thread or a post)
OPTIONAL = {"master": ("bf16",), "grad_sync": (False,), "logits": ("bf16",), "reshard": (False,),
            "fp8_weights_saved": (True,), "fp8_all_gather": (False,), "fp8_fused_casts": (True,),
            "fp8_recipe": ("rowwise",),
            "tokens_per_s": None, "step_s": None, "memory_gb": None, "url": None}


def _load():
    spec = importlib.util.spec_from_file_location("published", os.path.join(ROOT, "published.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows():
    with open(_load().ROWS) as f:
        return json.load(f)["rows"]


def test_every_row_quotes_its_source_and_the_figures_it_records():
    mod = _load()
    with open(mod.ROWS) as f:
        rows = json.load(f)["rows"]
    assert len(rows) >= 20 and len({r["project"] for r in rows}) >= 4
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["held_out"] in (True, False), r["id"]
        # a row added held out and later tuned on keeps its date and says when it was tuned on
        assert not (r["held_out"] and "tuned_on" in r), r["id"]
        dated = {"added", "round"} | ({"tuned_on"} if "tuned_on" in r else set())
        extra = set(r) - FIELDS - dated
        assert set(r) >= FIELDS and extra <= set(OPTIONAL), (r["id"], extra)
        assert all(OPTIONAL[k] is None or r[k] in OPTIONAL[k] for k in extra), r["id"]
        assert r["quote"] and r["table"] and r["notes"], r["id"]
        assert len(r["commit"]) == 40 and r["repo"].count("/") == 1 and r["path"], r["id"]
        tps = r["tokens_per_s_per_gpu"]
        if "tokens_per_s" in r:  # the source's figure is all GPUs'
            assert tps == round(r["tokens_per_s"] / r["gpus"], 2), r["id"]
            tps = r["tokens_per_s"]
        if "step_s" in r:  # the source's figure is a step's seconds
            tokens = r["micro_batch"] * r["seq"] * r["grad_accum"]
            assert tps == round(tokens / r["step_s"], 2), r["id"]
            tps = r["step_s"]
        assert any(re.search(rf"(^|[| ]){re.escape(text)}($|[| ])", r["quote"])
                   for text in (f"{tps:,}", str(tps), f"{tps:.2f}")), r["id"]
        if "url" in r:
            assert r["url"].startswith("https://"), r["id"]
        if "memory_gb" in r:  # the source's figure is decimal GB
            assert r["memory_gib"] == round(r["memory_gb"] * 1e9 / 2**30, 2), r["id"]
            assert str(r["memory_gb"]) in r["quote"], r["id"]
        elif r["memory_gib"] is not None:
            assert str(r["memory_gib"]) in r["quote"], r["id"]
        if r["memory_gib"] is not None:
            assert r["memory_kind"] in ("reserved", "allocated"), r["id"]
        assert r["precision"] in ("bf16", "float8") and r["recompute"] in (False, "full",
                                                                           "selective")
        assert r["compile"] in (True, False, "blocks") and r["repo"] in mod.SYSTEMS
        assert r["hw"] in mod.PROFILES and r["model"] in mod.MODELS, r["id"]


def test_held_out_rows_come_dated_from_sources_the_tuned_rows_did_not_use():
    # issue 40: rows the estimator was not tuned to, from projects not among the tuned rows';
    # each says when it was added, and none comes from a table (repository, path and table, at
    # any commit) a tuned row was taken from. Of the first 33, 18 were tuned on on 2026-12-05
    # (float8's GEMM rate and casts, torch AdamW's bf16 moments): 15 still held out; a second
    # pass on one day is dated with a letter (2026-12-05b)
    with open(_load().ROWS) as f:
        rows = json.load(f)["rows"]
    held = [r for r in rows if r["held_out"]]
    tuned = [r for r in rows if not r["held_out"]]
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["added"]) for r in held)
    assert len(held) >= 15 and len({r["project"] for r in held} - {r["project"] for r in tuned}) >= 1
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}[a-z]?", r["tuned_on"]) and r["tuned_on"] >= r["added"]
               for r in tuned if "tuned_on" in r)
    sources = {(r["repo"], r["path"], r["table"]) for r in tuned}
    assert not [r["id"] for r in held if (r["repo"], r["path"], r["table"]) in sources]


# issue 40's later rounds, each added while the estimator was changed on the rounds before
# it, from sources (repository, path and table, or thread) no earlier row cites: round ->
# (rows, float8 rows, rows with memory (reserved or allocated, as the source measured),
# projects no earlier row came from). Round 4: the brief's minimums. Round 6: one new
# project (VectorLM; the brief asked for two, a second was not found, docs/estimate.md).
# Round 7, float8 first, each row with its peak reserved memory as torchtitan logs it: no
# new project (torchao's PRs #2594 and #2595; the brief asked for 10 rows, six were
# established).
ROUNDS = {4: (15, 4, 6, 2), 5: (15, 4, 10, 2), 6: (20, 6, 10, 1), 7: (6, 6, 6, 0)}


@pytest.mark.parametrize("n", sorted(ROUNDS))
def test_a_later_round_is_held_out_from_sources_no_earlier_row_cites(n):
    rows, float8, memory, projects = ROUNDS[n]
    new, old = _round(n)
    assert len(new) >= rows and sum(r["precision"] == "float8" for r in new) >= float8
    assert sum(r["memory_gib"] is not None and r["memory_kind"] in ("reserved", "allocated")
               for r in new) >= memory
    assert len({r["project"] for r in new} - {r["project"] for r in old}) >= projects


def _round(n: int):
    """Round ``n``'s rows (held out and dated) and the rows before it, after checking that none
    of the round's rows comes from a source an earlier row cites."""
    rows = _rows()
    new = [r for r in rows if r.get("round") == n]
    old = [r for r in rows if r.get("round", 0) < n]
    # each held out, or tuned on since and dated so (2026-12-05's float8 memory: thunder's 6)
    assert new and all((r["held_out"] or "tuned_on" in r) and r["added"] for r in new)
    cited = {(r["repo"], r["path"], r["table"]) for r in old} | {r.get("url") for r in old}
    assert not [r["id"] for r in new if (r["repo"], r["path"], r["table"]) in cited
                or r.get("url", "-") in cited]
    return new, old


def test_the_comparison_prints_every_row_and_the_bands(capsys, tmp_path):
    out = tmp_path / "p.json"
    assert _load().main(["--json", str(out)] + [a for n in (4, 5, 6, 7) for a in ("--round", str(n))]) == 0
    text = capsys.readouterr().out
    assert "bf16 tokens/s" in text and "float8 tokens/s" in text and "memory" in text
    held = text[text.index("held-out rows"):]
    assert "bf16 tokens/s" in held and "float8 tokens/s" in held and "memory" in held
    for n in (4, 5, 6, 7):  # each round's own bands: every kind with held-out rows, "no rows" else
        part = text[text.index(f"held-out rows of round {n}"):].split(f"held-out rows of round {n + 1}")[0]
        held_n = [r for r in _rows() if r["held_out"] and r.get("round") == n]
        for label, has in (("bf16 tokens/s    ", any(r["precision"] == "bf16" for r in held_n)),
                           ("float8 tokens/s  ", any(r["precision"] == "float8" for r in held_n)),
                           ("memory           ", any(r["memory_gib"] is not None for r in held_n))):
            assert label + ("within" if has else "no rows") in part, (n, label)
    records = json.loads(out.read_text())
    assert all(r["predicted_tps"] > 0 for r in records) and len(records) >= 20
    assert {r["id"] for r in records if r["held_out"]} == {r["id"] for r in _rows() if r["held_out"]}


def test_the_bf16_rows_the_kernel_model_was_not_fitted_on_hold_the_band():
    # its three fitted numbers (docs/estimate.md) came from llm-foundry's H100 rows and
    # torchtitan's 8-GPU rows: torchtitan's 128-GPU rows and llm-foundry's A100 rows were not
    # fitted, though seen while it was built (the later held-out rows are reported, not held
    # to the band here)
    mod = _load()
    held = [r for r in _rows() if r["precision"] == "bf16" and r["hw"] != "h100"
            and r["id"] not in ("tt-8x-eager", "tt-8x-compile") and "added" not in r]
    assert len(held) == 7
    for r in held:
        est = mod.predict(r)
        assert abs(est.tokens_per_s / est.gpus / r["tokens_per_s_per_gpu"] - 1) <= 0.15, r["id"]


def test_memory_lands_within_the_band_on_what_each_source_measured():
    # issue 40: at least 80 % of the rows with memory within +-10 % (torchtitan's logs: the
    # peak reserved; FSDP2's stream pools, the loss's peak eager or fused, all from the
    # sources' settings, nothing fitted); every row within +-15 %. The rows it was worked out
    # on only (no date added): the later rows' results are reported (docs/estimate.md), not
    # asserted
    mod = _load()
    rows = [r for r in _rows() if r["memory_gib"] is not None and "added" not in r]
    assert len(rows) >= 9
    ratios = []
    for r in rows:
        est = mod.predict(r)
        got = est.peak_reserved if r["memory_kind"] == "reserved" else est.peak_allocated
        ratios.append(got / 2**30 / r["memory_gib"])
    assert sum(abs(x - 1) <= 0.10 for x in ratios) >= 0.8 * len(ratios), ratios
    assert all(abs(x - 1) <= 0.15 for x in ratios), ratios
