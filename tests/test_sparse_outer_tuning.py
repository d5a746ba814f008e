"""What `benchmarks.sparse_outer --tune` tries, and which reference each run is compared with."""

import pytest

from benchmarks.sparse_outer import RUNS, candidates, parse_args, summarise, tunable

pytestmark = pytest.mark.timeout(60)


def test_each_tuned_momentum_is_tried_at_the_same_effective_outer_steps():
    args = parse_args(
        ["--out", "/unused", "--tune", "--tune_momenta", "0,0.9", "--tune_lr_factors", "0.5,1,2"]
    )
    tried = candidates(RUNS["dense_2bit"], args)
    steps = {
        m: sorted({round(c["lr"] / (1 - m), 6) for c in tried if c["momentum"] == m}) for m in (0.0, 0.9)
    }
    # lr 0.7 at momentum 0.9 steps like lr 7 without momentum: SparseLoCo's shape is among the tries
    assert steps[0.0] == pytest.approx([3.5, 7.0, 14.0])
    assert steps[0.9] == pytest.approx([3.5, 7.0, 14.0])


def test_inner_lrs_are_tried_for_every_run_only_when_asked():
    plain = parse_args(["--out", "/unused", "--tune"])
    assert {c["inner_lr"] for c in candidates(RUNS["diloco_fp32"], plain)} == {None}
    asked = parse_args(["--out", "/unused", "--tune", "--tune_inner_lrs", "1e-3,3e-3"])
    assert {c["inner_lr"] for c in candidates(RUNS["sparse2bit"], asked)} == {1e-3, 3e-3}


def test_a_muon_codec_run_brings_and_is_compared_with_the_fp32_run_of_the_same_inner_optimizer():
    args = parse_args(["--out", "/unused", "--runs", "dense_2bit_muon", "--seeds", "1"])
    assert args.runs == ["diloco_fp32", "diloco_fp32_muon", "dense_2bit_muon"]
    result = dict(loss=1.0, payload_bytes_per_peer=100, wire_bits_per_value_per_round=32.0)
    results = {
        "diloco_fp32": {1: dict(result, loss=2.0)},
        "diloco_fp32_muon": {1: dict(result, loss=1.5)},
        "dense_2bit_muon": {1: dict(result, loss=1.8)},
    }
    runs = {name: dict(RUNS[name]) for name in args.runs}
    out = summarise(runs, results, args)
    assert out["dense_2bit_muon"]["eval_loss_ratio"] == pytest.approx(0.9)  # × AdamW's DiLoCo
    assert out["dense_2bit_muon"]["eval_loss_ratio_same_inner"] == pytest.approx(1.2)  # the codec's own cost
    assert out["diloco_fp32_muon"]["eval_loss_ratio_same_inner"] == pytest.approx(1.0)
    assert out["diloco_fp32"]["eval_loss_ratio_same_inner"] == pytest.approx(1.0)


def test_tune_runs_limits_tuning_to_the_runs_named_and_refuses_one_not_run():
    runs = {name: RUNS[name] for name in ("diloco_fp32", "sparse2bit", "streaming_fp32")}
    every = parse_args(["--out", "/unused", "--tune", "--runs", "sparse2bit,streaming_fp32"])
    assert tunable(runs, every) == ["diloco_fp32", "sparse2bit", "streaming_fp32"]
    named = parse_args(["--out", "/unused", "--tune", "--runs", "sparse2bit", "--tune_runs", "sparse2bit"])
    assert tunable(runs, named) == ["sparse2bit"]
    with pytest.raises(SystemExit):
        parse_args(["--out", "/unused", "--tune", "--runs", "sparse2bit", "--tune_runs", "dense_2bit"])
