"""Regenerate the `reference` field of every track's definition.json from its reference.py.

    uv run python tools/sync_definitions.py           # rewrite stale JSONs
    uv run python tools/sync_definitions.py --check   # exit 1 if any JSON is stale
"""

from __future__ import annotations

import argparse
import sys

from hopperbench.definitions import is_definition_current, render_definition_text
from hopperbench.paths import REPO_ROOT
from hopperbench.tracks import TRACKS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale definitions; write nothing")
    args = parser.parse_args(argv)

    stale = [track for track in TRACKS.values() if not is_definition_current(track)]
    if args.check:
        if stale:
            names = ", ".join(str(t.definition_path.relative_to(REPO_ROOT)) for t in stale)
            print(f"stale definitions (run tools/sync_definitions.py): {names}", file=sys.stderr)
            return 1
        return 0
    for track in stale:
        track.definition_path.write_text(render_definition_text(track), encoding="utf-8")
        print(f"updated {track.definition_path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
