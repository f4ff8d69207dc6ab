"""experiments.py end to end on the tiny model: every part runs and writes its figure and numbers."""

import experiments


def test_quick_pipeline_writes_every_figure(tmp_path):
    results = experiments.main(["--quick", "--out", str(tmp_path)])
    assert set(results) >= {"difficulty", "compare", "variants", "scatter", "scale"}
    assert set(results["difficulty"]) == set(experiments.LEVELS)
    assert set(results["compare"]) == {"grpo", "avspo", "aapo"}
    assert len(results["compare"]["grpo"]["acc_after"]["values"]) == 2  # two seeds
    assert len(results["scatter"]["points"]) == 8  # 2 seeds x (grpo, avspo, aapo, avspo-k1)
    for name in ("acr_vs_difficulty", "compare", "avspo_variants", "early_acr_vs_accuracy"):
        assert (tmp_path / "figures" / f"{name}.png").stat().st_size > 5_000
