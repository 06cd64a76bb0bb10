#!/usr/bin/env bash
# An earlier commit's kernels/ package as .devcache/baseline_kernels (imports renamed to match), for
# bench/gemv_ab.py --baseline-package .devcache: the GEMV of that commit with its own shared epilogue, timed
# against the tree's in one process. Run here (the GPU machine has no .git), then carry .devcache:
#
#   bash bench/baseline_kernels.sh <commit>
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:?usage: bench/baseline_kernels.sh <commit>}
dest=.devcache/baseline_kernels
rm -rf "$dest" .devcache/kernels
mkdir -p .devcache
git archive "$commit" kernels | tar -x -C .devcache
mv .devcache/kernels "$dest"
grep -rl --include='*.py' 'kernels' "$dest" | xargs sed -i -E 's/\b(from|import) kernels([. ])/\1 baseline_kernels\2/g'
echo "$dest: kernels/ of $(git rev-parse --short "$commit")"
