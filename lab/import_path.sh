#!/usr/bin/env bash
# Makes dflashkit importable without installing it (a GPU machine without network or pip access): a folder of
# symbolic links that maps the repository's folders into the dflashkit namespace as pyproject.toml does, so the
# checkout's code is what runs. Prints the folder to put on PYTHONPATH:
#   export PYTHONPATH=$(bash lab/import_path.sh /tmp/dflashkit-path):$PYTHONPATH
set -eu
dest=${1:-/tmp/dflashkit-path}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$dest/dflashkit"
for f in "$root"/dflashkit/*.py; do ln -sf "$f" "$dest/dflashkit/"; done
for p in drafter targets extract train eval; do ln -sfn "$root/$p" "$dest/dflashkit/$p"; done
for p in bench lab; do ln -sfn "$root/$p" "$dest/$p"; done  # python -m bench.X / lab.X from any folder
echo "$dest"
