"""Coverage-guided fuzzing of the metadata reader with atheris (not collected by pytest).

Run: ``python tests/reliability/fuzz_metadata_atheris.py -runs=100000``. The
input is taken as the JSON text of the metadata: if it parses, it is stored
with a matching checksum (a hostile author), else stored as the raw root
document (a damaged disk). Then the checkpoint is read and loaded. Any
exception other than a GpuckptError (or a known bug listed in
``hostile.KNOWN_BUGS``) is a crash.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import atheris

# coverage of what reads a root document: the format, its checks, the plan of a load (not
# the stdlib, NumPy or the save and distributed paths, whose instrumentation took 10 s a start)
with atheris.instrument_imports(
    include=[
        "gpuckpt.format",
        "gpuckpt.loading",
        "gpuckpt.planning",
        "gpuckpt.metadata",
        "gpuckpt.state",
        "gpuckpt.api",
    ]
):
    import gpuckpt
    import gpuckpt.api
    import gpuckpt.format.documents
    import gpuckpt.format.values
    import gpuckpt.loading.checks
    import gpuckpt.metadata
    import gpuckpt.state

sys.path.insert(0, str(Path(__file__).parent))
from hostile import is_known_bug, make_state

from gpuckpt.format.checksum import crc32c
from gpuckpt.format.documents import _canonical

# (libFuzzer ends the process without Python's exit handlers: a caller that wants the files
# gone gives a directory of its own, as the test does)
_DIR = Path(tempfile.mkdtemp(prefix="gpuckpt-atheris-", dir=os.environ.get("GPUCKPT_FUZZ_DIR") or None))
CKPT = _DIR / "c"
gpuckpt.save(make_state(), CKPT, chunk_bytes=64)
SEED_MD = json.loads((CKPT / "zarr.json").read_bytes())["attributes"]["gpuckpt"]["metadata"]


def one_input(data: bytes) -> None:
    try:
        md = json.loads(data)
        doc = {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {"gpuckpt": {"metadata": md, "metadata_crc32c": crc32c(_canonical(md))}},
        }
        raw = json.dumps(doc).encode()
    except (ValueError, TypeError, RecursionError):
        raw = data
    (CKPT / "zarr.json").write_bytes(raw)
    try:
        gpuckpt.read_metadata(CKPT)
        gpuckpt.load_state_dict(CKPT)
    except gpuckpt.GpuckptError:
        pass
    except Exception as exc:
        if not is_known_bug(exc):
            raise


def main() -> None:
    corpus = _DIR / "corpus"
    corpus.mkdir()
    (corpus / "seed.json").write_text(json.dumps(SEED_MD))
    atheris.Setup([*sys.argv, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
