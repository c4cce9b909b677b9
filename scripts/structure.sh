#!/usr/bin/env bash
# The structure figures of docs/structure.md, each from a maintained tool:
#   lines          git ls-files + wc: per top-level folder, the config, files over 800 lines
#   functions      ruff: C901 (complexity > 10), PLR0912 (> 12 branches), PLR0915 (> 50
#                  statements); lizard: functions over 60 lines
#   repeated code  lizard's duplicate extension (-Eduplicate: runs of 70 or more tokens alike
#                  but for names and constants)
#   imports        lint-imports (the contracts of pyproject.toml); grimp (import-linter's own
#                  graph): modules and direct imports of eagle3
#   config route   scripts/config_route.py (no maintained tool follows one parameter through
#                  calls: it records the route with Python's profiler hook while two tiny
#                  pipelines run, ~30 s)
#
#   bash scripts/structure.sh             # this checkout
#   bash scripts/structure.sh DIR         # another checkout (e.g. `git worktree add DIR REV`),
#                                         # measured with this checkout's tools
#   NO_ROUTE=1 bash scripts/structure.sh  # without the recorded route
set -eu  # no pipefail: lizard exits non-zero when it prints a warning
here=$(cd "$(dirname "$0")/.." && pwd)
root=$(cd "${1:-$here}" && pwd)
bin=$here/.venv/bin
cd "$root"
lib=(src flows tasks blocks)

echo "== lines (git ls-files | wc -l)"
git ls-files | grep -E '\.(py|sh)$' | xargs wc -l | awk '
  $2 != "total" {
    top = $2; sub(/\/.*/, "", top); if (top == $2) top = "(root)"; n[top] += $1; all += $1
  }
  END { for (t in n) printf "  %-12s %6d\n", t "/", n[t]; printf "  %-12s %6d\n", "all", all }' |
  sort -k2 -nr
echo "  config:      $(git ls-files 'src/eagle3/config.py' 'src/eagle3/config/*.py' \
  'src/eagle3/config_fields.py' 'src/eagle3/train_options.py' | xargs wc -l | tail -1 |
  awk '{print $1}') lines in $(git ls-files 'src/eagle3/config.py' 'src/eagle3/config/*.py' \
  'src/eagle3/config_fields.py' 'src/eagle3/train_options.py' | wc -l) file(s)"
echo "  library files over 800 lines: $(git ls-files "${lib[@]}" | grep '\.py$' | xargs wc -l |
  awk '$2 != "total" && $1 > 800 {printf "%s (%d) ", $2, $1; n++} END {if (!n) print "none"}')"

echo "== functions (ruff, lizard) in ${lib[*]}"
"$bin/ruff" check --isolated --select C901,PLR0912,PLR0915 --statistics --exit-zero "${lib[@]}" |
  sed 's/^/  /'
echo "  over 60 lines (lizard -L 60): $("$bin/lizard" -l python -L 60 -C 1000 -a 100 -w \
  "${lib[@]}" | wc -l)"

echo "== repeated code (lizard -Eduplicate, 70 tokens)"
"$bin/lizard" -l python -Eduplicate "${lib[@]}" benchmarks scripts tests 2>/dev/null | awk '
  /^Duplicate block/ { n++ } /^Total duplicate rate/ { rate = $4 }
  END { printf "  duplicate blocks: %d (duplicate rate %s)\n", n, rate }'

echo "== imports (lint-imports, grimp)"
(PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" "$bin/lint-imports" 2>&1 || true) |
  grep -E '^Contracts:|does not exist' | sed 's/^/  /'
PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" "$bin/python" - <<'EOF'
import grimp

g = grimp.build_graph("eagle3")
imports = sum(len(g.find_modules_directly_imported_by(m)) for m in g.modules)
print(f"  eagle3: {len(g.modules)} modules, {imports} direct imports between them")
EOF

if [ "${NO_ROUTE:-0}" != 1 ]; then
  echo "== config route (scripts/config_route.py: recorded on two tiny pipelines)"
  "$bin/python" "$here/scripts/config_route.py" --root "$root" 2>/dev/null | sed 's/^/  /'
fi
