# A/B of the host-copy change (session 5): new, old, new, old; plain decode B = 1 and 64
set -u
cp graphrt/runtime.py ab_old/runtime.new.py; cp graphrt/cycle.py ab_old/cycle.new.py; cp capture/validate.py ab_old/validate.new.py
for round in 1 2; do
  for v in new old; do
    if [ $v = old ]; then cp ab_old/runtime.py graphrt/runtime.py; cp ab_old/cycle.py graphrt/cycle.py; cp ab_old/validate.py capture/validate.py
    else cp ab_old/runtime.new.py graphrt/runtime.py; cp ab_old/cycle.new.py graphrt/cycle.py; cp ab_old/validate.new.py capture/validate.py; fi
    python3 -m graphrt bench --no-draft --batch-sizes 1,64 --max-new-tokens 128 --json "$OUT/ab_$v$round.json" 2>&1 \
      | grep -E '^plain' | sed "s/^/$v$round /"
  done
done
