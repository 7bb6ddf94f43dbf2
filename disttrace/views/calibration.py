"""`disttrace calibrate` (and `run --calibrate`): the measured noise (analysis/calibration.py's
`CalibrationDoc`), on a terminal."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from disttrace.analysis.calibration import CalibrationDoc


def render_calibration(doc: CalibrationDoc, path: Path, console: Console) -> None:
    """Whether the repeat was bit-identical, the noise per step and phase, and where the file was written."""
    console.print(
        Text(
            f"repeat run bit-identical: {doc.repeat_bit_identical} (max rel err "
            f"{doc.repeat_max_rel_err:.2e}); perturbation {doc.perturbation.relative:.2e} "
            f"relative; noise taken on the {doc.scale} scale"
        )
    )
    for step, phases in doc.noise.items():
        console.print(
            Text(f"  step {step}: " + ", ".join(f"{p} {v:.2e}" for p, v in phases.items()))
        )
    console.print(
        Text(
            f"calibrated bound = {doc.safety:g} x noise, per step, phase and tensor class "
            f"({', '.join(doc.classes)}), written to {path}"
        )
    )
