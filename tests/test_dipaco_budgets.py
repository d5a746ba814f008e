"""The budget sweep of `benchmarks.dipaco`: budgets multiply every arm's counted steps, seeds change
the runs, dipaco.json's `budgets` and `crossover` carry what the crossover plot needs."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from benchmarks import dipaco
from benchmarks.dipaco_budgets import crossover, parse_budgets

ARMS = ("dipaco 2x2", "dense", "dense same tokens", "dense all params")


def test_budget_two_trains_every_arm_twice_the_steps_of_budget_one_and_seeds_give_a_spread(tmp_path):
    argv = f"--out {tmp_path} --builtin_docs 400 --steps_per_path 4 --warm_start_steps 3 --d_model 16"
    argv += " --seq_len 16 --batch_size 2 --inner_steps 2 --max_eval_docs 20 --budgets 1,2 --seeds 1,2"
    argv += " --device cpu --threads 1"
    assert dipaco.main(argv.split()) == 0
    r = json.loads((tmp_path / "dipaco.json").read_text())
    one, two = r["budgets"]["1"], r["budgets"]["2"]
    # steps are the loops' own counts (InnerLoop.step_count), not the requested numbers
    assert (
        one["warm_start_steps"],
        one["steps_per_path"],
        two["warm_start_steps"],
        two["steps_per_path"],
    ) == (
        3,
        4,
        6,
        8,
    )
    assert one["steps"] == {
        "dipaco 2x2": 3 + 16,
        "dense": 3 + 4,
        "dense same tokens": 3 + 16,
        "dense all params": 19,
    }
    assert two["steps"] == {arm: 2 * n for arm, n in one["steps"].items()}
    assert two["tokens"] == {arm: 2 * n for arm, n in one["tokens"].items()}
    for b in (one, two):
        for key in ("composite_ppl", "dense_ppl", "dense_same_tokens_ppl", "dense_all_params_ppl"):
            s = b[key]
            assert len(s["per_seed"]) == 2 and s["min"] <= s["mean"] <= s["max"]
            assert s["std"] == pytest.approx(statistics.stdev(s["per_seed"]))
        assert b["ratio_same_tokens"]["per_seed"] == [
            c / d
            for c, d in zip(
                b["composite_ppl"]["per_seed"], b["dense_same_tokens_ppl"]["per_seed"], strict=True
            )
        ]
        assert b["tokens_per_param_same_tokens"] == b["tokens"]["dense same tokens"] / r["path_params"]
        assert (
            b["tokens_per_param_path"]
            == (b["warm_start_steps"] + b["steps_per_path"]) * 2 * 16 / r["path_params"]
        )
        assert set(b["epochs"]) == set(ARMS) and b["data_repeats"] is False
        assert b["epochs"]["dense same tokens"] == b["tokens"]["dense same tokens"] / r["corpus_tokens"]
    # the two seeds are two different runs (initialisation and data order), not one run twice
    assert one["composite_ppl"]["per_seed"][0] != one["composite_ppl"]["per_seed"][1]
    assert set(r["crossover"]) == {"ratio_same_tokens", "ratio_all_params"}
    assert r["device"] == "cpu" and r["dtype"] == "fp32"
    # the one run the older keys describe: budget 1, first seed
    assert r["composite_ppl"] == one["composite_ppl"]["per_seed"][0] and r["steps_per_path"] == 4
    assert (tmp_path / "dipaco_budgets.png").stat().st_size > 10_000
    assert set(json.loads((tmp_path / "dipaco_runs.json").read_text())) == {"1", "2"}
    assert "| ×2 |" in (tmp_path / "dipaco.md").read_text()


def test_a_crossover_between_budgets_is_measured_and_one_beyond_them_is_an_extrapolation():
    met = crossover([1.0, 10.0], [1.2, 0.8])
    assert met["reached"] and met["tokens_per_param"] == pytest.approx(math.sqrt(10))
    ahead = crossover([1.0, 10.0, 100.0], [1.4, 1.2, 1.0 + 1e-9])
    assert not ahead["reached"] and ahead["method"].startswith("extrapolation")
    assert ahead["tokens_per_param"] == pytest.approx(100.0, rel=1e-6)
    away = crossover([1.0, 10.0], [1.1, 1.3])
    assert away["tokens_per_param"] == pytest.approx(10**-0.5) and "below the smallest" in away["method"]


@pytest.mark.parametrize("text", ["1,0", "1,x", "2,2", "-1"])
def test_a_bad_budget_list_is_refused_naming_the_flag(text):
    with pytest.raises(SystemExit, match="--budgets"):
        parse_budgets(text)


def test_sweeps_run_in_parts_combine_into_one_and_a_part_with_other_settings_is_refused(tmp_path):
    """The H100 sweep ran in two device calls (budgets 0.25, 1, 2.5; then 4): combined, every budget
    is there in order with its seeds; a part trained with another batch size cannot join them."""
    import json
    import shutil
    from pathlib import Path

    from benchmarks.dipaco_combine import combine, main

    docs = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "dipaco"
    parts = [docs / "h100_stdlib", docs / "h100_stdlib_x4"]
    budgets, found, settings = combine(parts)
    assert list(budgets) == ["0.25", "1", "2.5", "4"] and settings["batch_size"] == 128
    assert budgets["1"]["seeds"] == [1, 2] and budgets["4"]["seeds"] == [1]
    xs = [b["tokens_per_param_same_tokens"] for b in budgets.values()]
    assert xs == sorted(xs) and found["ratio_same_tokens"]["tokens_per_param"] > xs[-1]
    assert main(["--out", str(tmp_path / "all"), *map(str, parts)]) == 0
    assert (tmp_path / "all" / "dipaco_budgets.png").stat().st_size > 10_000
    odd = tmp_path / "odd"
    shutil.copytree(parts[1], odd)
    runs = json.loads((odd / "dipaco_runs.json").read_text())
    runs["4"][0]["batch_size"] = 16
    (odd / "dipaco_runs.json").write_text(json.dumps(runs))
    with pytest.raises(SystemExit, match="batch_size"):
        combine([parts[0], odd])


def test_held_out_documents_are_a_seeded_sample_of_the_whole_evaluation_split_not_its_first(tmp_path):
    from peer.data.sources import split_of

    # A file in source-tree order: the first evaluation documents are all of one kind.
    texts = [f"module {i:05d} " + ("alpha " if i < 3000 else "omega ") * 8 for i in range(6000)]
    data = tmp_path / "ordered.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = dipaco.parse_args(
        ["--out", str(tmp_path / "o"), "--data_files", str(data), "--max_eval_docs", "40"]
    )
    spec, train, held_out, _ = dipaco.load_data(args)
    again = dipaco.load_data(args)[2]
    evaluation = [t for t in texts if split_of(t, spec) == "eval"]
    assert held_out == again and len(held_out) == 40 and set(held_out) <= set(evaluation)
    assert held_out != evaluation[:40]
    assert any("omega" in t for t in held_out) and any("alpha" in t for t in held_out)


def test_validation_documents_are_training_documents_no_arm_trains_on_and_never_reported_ones(tmp_path):
    texts = [f"doc {i:05d} " + "word " * (i % 13 + 4) for i in range(3000)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    argv = ["--out", str(tmp_path / "o"), "--data_files", str(data), "--max_eval_docs", "40"]
    _, all_train, _, none = dipaco.load_data(dipaco.parse_args(argv))
    _, train, held_out, validation = dipaco.load_data(dipaco.parse_args([*argv, "--validation_docs", "50"]))
    assert none == [] and len(validation) == 50
    assert set(validation) <= set(all_train) and not set(validation) & set(train)
    assert not set(validation) & set(held_out)
    assert sorted(train + validation) == sorted(all_train)


def test_tuning_picks_the_outer_optimizer_by_validation_perplexity_never_by_the_reported_one(tmp_path):
    from benchmarks import dipaco_tune

    def grid(seed, lr, val, reported):
        return dict(budget="2.5", seed=seed, outer_lr=lr, outer_momentum=0.9, inner_steps=50,
                    val_ppl=val, composite_ppl=reported, batch_size=128)  # fmt: skip

    # lr 1.0 scores best on the reported documents, lr 0.5 on the validation split
    runs = [grid(s, 1.0, 5.0, 3.0) for s in (1, 2)] + [grid(s, 0.5, 4.0, 3.5) for s in (1, 2)]
    runs.append(grid(1, 0.2, 1.0, 1.0))  # one seed only: not comparable, never picked
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "dipaco_tune_runs.json").write_text(json.dumps(runs))
    for seed in (1, 2):
        base = dict(args=dict(seed=seed, outer_lr=0.7, outer_momentum=0.9, inner_steps=50),
                    composite_val_ppl=4.5, composite_ppl=3.6, batch_size=128, dense_same_tokens_ppl=3.4,
                    dense_all_params_ppl=None, dense_ppl=4.0)  # fmt: skip
        (tmp_path / f"base{seed}").mkdir()
        (tmp_path / f"base{seed}" / "dipaco_runs.json").write_text(json.dumps({"2.5": [base]}))
    assert dipaco_tune.main(["--out", str(tmp_path / "pick"), "--pick", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "pick" / "dipaco_tune.json").read_text())
    assert out["pick"]["outer_lr"] == 0.5 and len(out["candidates"]) == 3
    assert out["pick_ratio_same_tokens"] == 3.5 / 3.4 and out["default_ratio_same_tokens"] == 3.6 / 3.4
    runs[0]["batch_size"] = 64
    (tmp_path / "tune" / "dipaco_tune_runs.json").write_text(json.dumps(runs))
    with pytest.raises(SystemExit, match="batch_size"):
        dipaco_tune.main(["--out", str(tmp_path / "pick"), "--pick", str(tmp_path)])
