"""Numbered folders of the checkpoint folder (`step_*` checkpoints, `weights/v_*` pushed
weights) left from a lineage that was lost.

A trainer resumes from its newest checkpoint and trains the steps after it again, numbering
them as before. Folders numbered above the resumed step are left from the lost steps of the run
before (stopped without a checkpoint covering them): kept, they would outrank the folders of
the steps trained again, so that pruning by number deletes a new folder before it is used and
a later resume picks an old one. The trainer deletes them when it starts (`drop_above`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)


def drop_above(root: Path, folders: dict[int, Path], step: int) -> int:
    """Delete the folders of `folders` (number -> folder under `root`) numbered above `step`,
    the step resumed from; log them; return how many."""
    above = sorted(n for n in folders if n > step)
    for n in above:
        shutil.rmtree(folders[n], ignore_errors=True)
    if above:
        log.warning(
            "deleted %d folders in %s numbered above step %d, the step resumed from (%s): "
            "left from a run whose later steps no checkpoint covers; those steps are trained "
            "again",
            len(above),
            root,
            step,
            ", ".join(str(n) for n in above),
        )
    return len(above)
