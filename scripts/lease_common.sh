# Shared by the device scripts (scripts/h200_gate_study.sh, scripts/h200_engine_ab.sh): sourced, not run.
#
# Why one file: both scripts reach a lent GPU through calls of at most ten minutes that carry at most
# 64 MiB, and both had their own copy of the deadline cut below; a fix to one copy (a call that waited
# past its limit handed nothing back) had to be made twice. The device's copy of the tree holds this
# file too, so sourcing it works there as here.

# The seconds a call may wait on its background job: WAIT (default $1), cut so that the call ends and
# hands its files back before its limit (CALL_S, default 600), less the seconds the script has already
# spent (bash's SECONDS) and 30 s to collect; never under 5 s, so a late call still collects.
wait_s() {
  local w=${WAIT:-$1} left=$(( ${CALL_S:-600} - SECONDS - 30 ))
  [ "$left" -lt "$w" ] && w=$left
  [ "$w" -lt 5 ] && w=5
  echo "$w"
}

# Here, after staging: which `carry` list fits what one call may carry. The device copies the tree
# (tracked and untracked-not-ignored files) plus the carried paths, 64 MiB in all; with the tree at
# ~34 MiB (two shipped drafters, benchmark JSON) a 28 MiB wheelhouse part and .carry no longer fit
# together, and the device refuses the call. A staging call needs only .whl: parts are filed under /tmp
# of the device, and the running jobs have their own copies. Prints the list; exit 1 if even .whl alone
# is over.
carry_advice() {
  local limit=$(( 64 * 1024 * 1024 )) tree whl car
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  whl=$(du -sb .whl 2>/dev/null | cut -f1); whl=${whl:-0}
  car=$(du -sb .carry 2>/dev/null | cut -f1); car=${car:-0}
  local mib=$(( 1024 * 1024 ))
  if [ $(( tree + whl + car )) -le "$limit" ]; then
    echo "carry [\".carry\", \".whl\"] ($(( (tree + whl + car + mib - 1) / mib )) of 64 MiB)"
  elif [ $(( tree + whl )) -le "$limit" ]; then
    echo "carry [\".whl\"] only ($(( (tree + whl + mib - 1) / mib )) of 64 MiB; with .carry it would be $(( (tree + whl + car + mib - 1) / mib )) MiB, over the limit)"
  else
    echo "over 64 MiB even without .carry: tree $(( tree / mib )) MiB + .whl $(( whl / mib )) MiB; stage one part a call" >&2
    return 1
  fi
}

# Here, when a wheelhouse is built: the largest part (e.g. 28M) that still travels beside the tree, 2 MiB
# kept for the part's install.sh and MANIFEST.json and the tree's growth; at most 28 MiB (parts of that
# size ran since the first lease). Parts are cut once and then staged call by call, so a tree that grew
# (a GPU drafter bundle of ~14 MB ships with the code) needs smaller parts: build the wheelhouse again.
# Exit 1 below 4 MiB: the tree itself must shrink.
part_size() {
  local mib=$(( 1024 * 1024 )) tree
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  local p=$(( (64 * mib - tree) / mib - 2 ))
  [ "$p" -gt 28 ] && p=28
  if [ "$p" -lt 4 ]; then
    echo "the tree is $(( tree / mib )) MiB: a wheelhouse part of 4 MiB no longer fits a call of 64 MiB" >&2
    return 1
  fi
  echo "${p}M"
}
