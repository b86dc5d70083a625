"""Text for the GAC benchmarks: the held-out corpora (KJV Bible, CPython standard library source) and a
second calibration domain (GCIDE, Webster 1913). Gemma-3-270M and the Python docs come from
`netgain.align.defaults` (the CLI's embedded default).

    python bench/gac_models.py      # convert the packaged Gemma-3-270M once into the user cache
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def kjv_text() -> str:
    """The King James Bible, from the Debian packages bible-kjv and bible-kjv-text."""
    try:
        return subprocess.run(["bible", "-l0", "gen1:1-rev22:21"], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError as error:
        raise SystemExit("the KJV corpus needs: apt-get install -y --no-install-recommends bible-kjv bible-kjv-text") from error


def stdlib_text(limit: int = 2_000_000) -> str:
    """The first `limit` characters of the CPython standard library's *.py files (sorted by path)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(p for p in root.glob("*.py")):
        parts.append(path.read_text(errors="replace"))
        size += len(parts[-1])
        if size >= limit:
            break
    return "\n\n".join(parts)[:limit]


def gcide_text(limit: int = 2_000_000) -> str:
    """The first `limit` characters of the GCIDE dictionary (Webster 1913), from the Debian package dict-gcide."""
    import gzip

    path = Path("/usr/share/dictd/gcide.dict.dz")
    if not path.exists():
        raise SystemExit("the GCIDE corpus needs: apt-get install -y --no-install-recommends dict-gcide")
    with gzip.open(path, "rt", errors="replace") as f:
        return f.read(limit)


if __name__ == "__main__":
    from netgain.align.defaults import packaged_gemma

    print(packaged_gemma())
