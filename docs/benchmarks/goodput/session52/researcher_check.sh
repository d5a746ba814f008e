#!/bin/bash
# The README researcher section as written, 3 peers on 2x2, --inner_steps 50 --max_rounds 24, own corpus
set -e
cd /tmp/rs; rm -rf corpus ckpt myrun.json creator.key logs; mkdir -p corpus logs
PY=/work/main/.venv/bin/python; PS="/work/main/.venv/bin/pathswarm"
$PY -m benchmarks.stdlib_corpus --out /tmp/rs/corpus.jsonl >/dev/null 2>&1 || (cd /work/main && $PY -m benchmarks.stdlib_corpus --out /tmp/rs/corpus.jsonl)
$PY -c "
import json
lines=[json.loads(l)['text'].replace('\n',' ') for l in open('/tmp/rs/corpus.jsonl')]
open('/tmp/rs/corpus/stdlib.txt','w').write('\n'.join(lines)[:1_700_000])"
$PS run create --name myrun --preset tiny --grid 2x2 --dataset text --data_files 'corpus/*.txt' \
    --inner_steps 50 --warm_start_steps 200 --out myrun.json --no_publish --identity_path creator.key > logs/create.log 2>&1
$PS bootstrap --host_maddrs /ip4/127.0.0.1/tcp/31337 --manifest_path myrun.json > logs/bootstrap.log 2>&1 &
BP=$!
for i in $(seq 1 60); do grep -q "initial_peers" logs/bootstrap.log && break; sleep 1; done
IP=$(grep -o "/ip4/127.0.0.1/tcp/31337/p2p/[A-Za-z0-9]*" logs/bootstrap.log | head -1)
echo "initial peers $IP"
for p in 0 1 2; do
  $PS peer --run myrun --initial_peers $IP --host_maddrs /ip4/127.0.0.1/tcp/0 --data_root . \
     --checkpoint_dir ckpt/peer$p --max_rounds 24 > logs/peer$p.log 2>&1 &
  eval "P$p=\$!"
done
wait $P0 $P1 $P2 || true
kill $BP; wait $BP 2>/dev/null || true
$PY - <<'PYEOF'
import re, datetime, glob
for f in sorted(glob.glob('/tmp/rs/logs/peer*.log')):
    ts=[]
    for line in open(f):
        m=re.match(r'(\S+ \S+) INFO peer.training.peer: round (\d+) step', line)
        if m: ts.append(datetime.datetime.strptime(m.group(1), '%Y-%m-%d %H:%M:%S,%f'))
    gaps=[(b-a).total_seconds() for a,b in zip(ts,ts[1:])]
    print(f, 'rounds', len(ts), 'max gap %.2f s' % max(gaps), 'median %.2f' % sorted(gaps)[len(gaps)//2], 'over 5 s:', sum(g>5 for g in gaps),
          'moves', sum('rotating from' in l for l in open(f)))
PYEOF
