"""benchmarks/proximal_map.py's families: within one pair of methods on one outcome across the map's cells, Holm's
correction applies to the equivalence tests as to the differences."""

from benchmarks.common.intervals import t_quantile
from benchmarks.proximal_map import family_tests


def _interval(mean: float, standard_error: float, n: int = 16) -> dict:
    half = t_quantile(0.975, n - 1) * standard_error
    return {"final": {"mean": mean, "low": mean - half, "high": mean + half, "n": n}}


def test_an_equivalence_shown_only_without_the_correction_is_not_resolved():
    # two cells whose TOST against +-0.05 passes alone (p about 0.02-0.04) but not once Holm counts the family's
    # 16 tests, one cell far inside the margin, and 13 clear differences
    differences = {
        f"loglinear-recompute-s{d}-k{k}-lr{rate}": _interval(0.2, 0.02)
        for k in (1, 4)
        for rate in ("hi", "lo")
        for d in (0, 2, 4, 8)
    }
    differences["loglinear-recompute-s8-k1-lrlo"] = _interval(0.003, 0.022)
    differences["loglinear-recompute-s8-k4-lrhi"] = _interval(-0.016, 0.019)
    differences["loglinear-recompute-s0-k1-lrlo"] = _interval(-0.001, 0.001)
    rows = family_tests(differences)["loglinear - recompute, final"]
    assert len(rows) == 16
    by_cell = {(r["staleness"], r["steps_per_batch"], r["lr"]): r for r in rows}
    for cell in ((8, 1, "lo"), (8, 4, "hi")):
        row = by_cell[cell]
        assert row["equivalence_p"] <= 0.05 < row["holm_equivalence_p"]  # equivalent uncorrected, not after Holm
        assert row["verdict"] == "not resolved"
    assert by_cell[(0, 1, "lo")]["verdict"] == "equivalent"  # far inside the margin: shown also after Holm
    assert sum(r["verdict"] == "difference" for r in rows) == 13
