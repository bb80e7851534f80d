#!/bin/bash
# Which sockets does a torchft replica group open? lighthouse + 1 replica group launched with plain python (no torchrun).
set -u
cd "$(dirname "$0")"; D=logs/listeners; mkdir -p $D; V=${VENV:-$PWD/venv-nightly/bin}
rm -f $D/rg0.jsonl; export OMP_NUM_THREADS=1 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 STEPS=40 STEP_SLEEP=0.1
$V/torchft_lighthouse --min_replicas 1 > $D/lighthouse.log 2>&1 & LH=$!
sleep 1
REPLICA_GROUP_ID=0 LOG=$D/rg0.jsonl $V/python train_ft.py > $D/rg0.out 2>&1 & P=$!
until grep -q '"step": 10,' $D/rg0.jsonl 2>/dev/null; do sleep 0.2; done
echo "lighthouse pid $LH, replica pid $P"; ss -ltnp | grep -E "pid=($LH|$P)," 
wait $P; echo "replica rc=$?"; kill $LH; wait $LH 2>/dev/null
