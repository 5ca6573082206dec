#!/usr/bin/env bash
# The device tool brings back at most 8 files from an output folder: past 7, every result but env.txt
# and log.txt goes into one archive, results.tgz. Usage: bash scripts/pack_results.sh "$OUT"
cd "${1:?output folder}" || exit 1
files=$(ls | grep -v -e '^env.txt$' -e '^log.txt$' -e '^results.tgz$')
if [ "$(ls | wc -l)" -gt 7 ] && [ -n "$files" ]; then tar czf results.tgz $files && rm -rf $files; fi
