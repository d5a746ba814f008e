"""Streaming DiLoCo on an emulated WAN: `python -m benchmarks.wan --out DIR`.

Six configurations train the same model on the same data with the same inner optimizer, batch and
number of steps, one after the other, each with `--peers` peers in their own network namespaces
whose egress is capped at `--cap_mbit` (`netlab`). The grid is 1×1, so every peer holds
every module: plain data-parallel DiLoCo, comparable with hivemind.Optimizer.

* `no_sync` — the compute ceiling: every peer is its own swarm (`--new_swarm`), so nothing is ever
  on the wire, and α = 1 with τ = 1, so its (own) outer step never touches the local model either:
  plain local AdamW. (Peers of one swarm with α = 1 would still spend CPU, bandwidth and waits on
  averaging; isolation measures compute alone.)
* `diloco_fp32` — blocking per-module DiLoCo: P = 1, τ = 0, fp32 outer gradients.
* `streaming_4bit` — P fragments synced H/P steps apart, overlapped τ steps, α = 0.5, a 4-bit codec.
  Unless `--overlap_steps` is given, τ is derived from the two runs before it: the step time of
  `no_sync` and the blocking sync time of `diloco_fp32` (see `derive_tau`).
* `streaming_sparse` — as `streaming_4bit` with the same P (and τ, unless `--sparse_overlap_steps`
  gives its own: with α = 0 the overlap's steps are dropped at the merge, so a shorter τ loses
  less), but `--sparse_codec` (default `sparse2bit`: the top 92 of each chunk of 4096 at 2 bits,
  Elias-Fano indices, the rest kept as error feedback) and SparseLoCo's outer step (no momentum,
  α = 0, `--sparse_outer_lr`, tuned with `benchmarks.sparse_outer` on its validation split).
* `hivemind_optimizer` — stock `hivemind.Optimizer(use_local_updates=True)` averaging parameters
  in fp32 every peers × batch × H samples, configured as hivemind's guide says for a small local
  run (matchmaking 5 s), plus one average after the last step when its epochs (which end a few
  steps past each H) came to fewer than DiLoCo's syncs (`hivemind_peer`). Averaging parameters is
  an outer SGD step with lr 1 and no momentum; hivemind has no place for DiLoCo's outer optimizer.
* `no_sync_end` — `no_sync` again, last: the ratios' denominator is the mean of both, so a machine
  that was faster or slower at one end of the lab flatters no configuration; both are reported.

The CPU model. Four peers share this box's two cores, so each peer's training thread (its main
thread) runs under a CPU quota, `--compute_cores` (a cgroup): its "accelerator". Everything else
of the peer runs outside the quota, `--comm_priority` nice levels above it (`PeerCpu`), as the host
CPU of a GPU peer would: DHT, p2pd, our sync service (encoding for nf4, decoding, aggregation,
digests) and hivemind's averager process (matchmaking, all-reduce) and optimizer thread (its AdamW
step runs in hivemind's executor thread). What the training thread itself does per sync stays
inside the quota (ours: the outer gradient, the merge, sparse encoding; the outer step and its
digest run on the outer-step thread). CPU seconds of both sides are recorded. Defaults
(3.2M-parameter model, batch 4×64 tokens, H = 48, P = 4) make `diloco_fp32` communication-bound at
20 Mbit/s and the whole run take about 12 minutes.

Measured per configuration (means over peers):
* `tokens_per_second_ratio_to_the_end` (the headline): per-peer tokens/s over `no_sync`'s (the mean
  of its two runs), from the moment all of a configuration's peers were training (start-up skew
  would otherwise flatter the early starters) to the final round's end, which comes after training
  stopped and the syncs in flight were drained (a streaming peer pays that once per run);
  `tokens_per_second_ratio` beside it stops at every peer's last round before its final one:
  steady state;
* `bytes_sent_per_peer_per_round`: egress on the peer's veth (everything: payload, DHT, TCP/IP
  headers) over that window, divided by the rounds (H inner steps) in it;
* `peak_bytes_per_sync`: the largest burst of bytes on a peer's veth in that window (`report.bursts`:
  a run of 0.2 s samples above 10% of the cap; a sync with its TCP/IP overhead), one wire unit for
  every configuration; `peak_payload_bytes_per_sync` beside it is the most outer-gradient bytes a
  peer sent for one sync event (its history's `peak_sync_bytes`; hivemind reports none);
* `matchmaking_seconds_per_sync` (mean, max over every peer's syncs): hivemind's, timed around
  `Matchmaking.look_for_group` per averaging round; ours have none (a round's group is the signed
  claim view's holders and it starts sending at once): 0 by construction, `measured: false`;
* `sync_seconds_per_sync`: seconds from a sync's start to its result (ours: `RoundResult.seconds`;
  hivemind: matchmaking plus all-reduce);
* `eval_loss`: mean next-token NLL on held-out documents (split "eval") after the same number of
  steps, of peer 0's global copy (the averaged model), or of its local model where there is no
  global one (`no_sync`, hivemind).

Writes DIR/wan.json, DIR/wan.md, DIR/wan.png and DIR/<config>/ (manifest, logs, checkpoints). Skips
(exit 0) where network namespaces cannot be made.

Modules: `options` (configurations and flags), `netlab` (namespaces, caps, loss, veth counters),
`cpu` (the peers' CPU quota and accounting), `driver` (configurations and their peers), `report`
(measurements, the no_sync baseline, targets, table, plot), `hivemind_peer` (the hivemind.Optimizer
baseline peer).
"""
