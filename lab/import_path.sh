#!/usr/bin/env bash
# Makes dflashkit importable without installing it (a GPU machine without network or pip access): a folder of
# symbolic links that maps the repository's folders into the dflashkit namespace as pyproject.toml does, so the
# checkout's code is what runs. Prints the folder to put on PYTHONPATH:
#   export PYTHONPATH=$(bash lab/import_path.sh /tmp/dflashkit-path):$PYTHONPATH PYTHONSAFEPATH=1
# The folder also links bench/ and lab/, so `python -m lab.X` runs from anywhere; PYTHONSAFEPATH=1 keeps
# `python -m` from putting the current folder first, where the checkout's root would shadow the dflashkit of the
# folder with its own dflashkit/ (the command and version only).
set -eu
dest=${1:-/tmp/dflashkit-path}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$dest/dflashkit"
for f in "$root"/dflashkit/*.py; do ln -sf "$f" "$dest/dflashkit/"; done
for p in drafter targets extract train eval; do ln -sfn "$root/$p" "$dest/dflashkit/$p"; done
for p in bench lab; do ln -sfn "$root/$p" "$dest/$p"; done  # python -m bench.X / lab.X from any folder
echo "$dest"
